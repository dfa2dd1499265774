"""``ROPEWALK_REDIS_URL=redis+sentinel://...`` (infra/config.py): the sentinels, the service, the database, and the
sentinels' own credentials; a URL that cannot be used is refused naming what is wrong."""
import re

import pytest

from infra.config import Config, SentinelUrl, sentinel_of

CASES = {
    "one sentinel": ("redis+sentinel://10.0.0.1:26379/rw", SentinelUrl((("10.0.0.1", 26379),), "rw", 0, {})),
    "three, a database": ("redis+sentinel://a:1,b:2,c:3/region/2",
                          SentinelUrl((("a", 1), ("b", 2), ("c", 3)), "region", 2, {})),
    "sentinels' credentials": ("redis+sentinel://ops:p%40ss@a:1/rw/0",
                               SentinelUrl((("a", 1),), "rw", 0, {"username": "ops", "password": "p@ss"})),
    "a plain Redis": ("redis://127.0.0.1:6379/0", None),
}


@pytest.mark.parametrize("url,want", CASES.values(), ids=CASES.keys())
def test_a_sentinel_url_is_parsed(url, want):
    assert sentinel_of(url) == want


@pytest.mark.parametrize("url,why", [
    ("redis+sentinel://a:1", "expected redis+sentinel://HOST:PORT"),
    ("redis+sentinel://a/rw", "sentinel 'a' is not HOST:PORT"),
    ("redis+sentinel://a:1/rw/x", "expected redis+sentinel://HOST:PORT"),
    ("redis+sentinel:///rw", "expected redis+sentinel://HOST:PORT"),
])
def test_a_sentinel_url_that_cannot_be_used_is_refused_at_start(url, why, tmp_path):
    with pytest.raises(ValueError, match=re.escape(why)):
        Config.from_env({"ROPEWALK_REDIS_URL": url, "ROPEWALK_RUN_DIR": str(tmp_path)})
