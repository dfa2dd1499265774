"""What every route of the API goes through (processors/api/routes/): the user of the request's bearer token
(``current_user``, from the users file read again when it changes), the ``Door`` a route acts through (the user,
each action authorized by ``authz.decide``, the shared front end as that user), ``call`` (a blocking front-end call
in the thread pool, the log failing to answer a 503), and the path and query parameters the routes share."""

from pathlib import Path
from typing import Annotated

from confluent_kafka import KafkaException
from fastapi import Depends, FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from processors.api import authz, users as users_mod
from processors.api.authz import User
from processors.api.errors import ApiError
from processors.frontend import service as fe
from processors.frontend.service import Frontend
from processors.times import MAX_MOMENT_CHARS
from streams.clients import DeliveryError

PRODUCER = "api"
UNAUTHENTICATED = "unauthenticated"
BROKER_UNAVAILABLE = "broker_unavailable"
USERS_UNREADABLE = "users_file_unreadable"
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$"  # rules.NAME
JOB_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}\.[A-Za-z0-9][A-Za-z0-9_-]{0,62}$"  # <entitlement>.<name>


class UsersFile:
    """The users file, read again whenever it changes (``ropewalk user add`` needs no restart)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._stamp: tuple | None = None
        self._users = users_mod.parse({})

    def current(self) -> users_mod.Users:
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = None
        if stamp != self._stamp:
            try:
                self._users = users_mod.load(self.path)
            except users_mod.UsersError as exc:
                raise ApiError(500, USERS_UNREADABLE, str(exc)) from None
            self._stamp = stamp
        return self._users


BEARER = HTTPBearer(auto_error=False, description="a token from `ropewalk user add` (or <secrets>/token)")


def current_user(request: Request, cred: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]) -> User:
    """The user of the request's bearer token (401 without one, or with an unknown one)."""
    if cred is None or cred.scheme.lower() != "bearer" or not cred.credentials:
        raise ApiError(401, UNAUTHENTICATED, "a bearer token is required (Authorization: Bearer <token>)",
                       {"WWW-Authenticate": "Bearer"})
    user = request.app.state.users.current().authenticate(cred.credentials)
    if user is None:
        raise ApiError(401, UNAUTHENTICATED, "unknown token", {"WWW-Authenticate": "Bearer"})
    return user


CurrentUser = Annotated[User, Depends(current_user)]


class Door:
    """What a route acts through: the request's ``user``, each action authorized (``allow``: 403 with the reason
    otherwise), and the shared front end as that user (``front``: it produces with the API's own broker principal
    and records the user in the envelope). ``app``: the API, whose state holds the configuration, the schema
    registry, the producer and the partition map (``create_app``)."""

    def __init__(self, app: FastAPI, user: User):
        self.app, self.user = app, user

    def allow(self, action: str, entitlement: str | None) -> None:
        d = authz.decide(self.user, action, entitlement)
        if not d.allowed:
            raise ApiError(403, d.reason, d.message)

    @property
    def front(self) -> Frontend:
        st = self.app.state
        return Frontend(st.cfg, st.registry, principal=self.user.name, producer=PRODUCER, events=st.producer,
                        partition_map=st.partition_map)


def door(request: Request, user: CurrentUser) -> Door:
    return Door(request.app, user)


Caller = Annotated[Door, Depends(door)]


async def call(fn, *args, **kwargs):
    """Run a blocking front-end call in the thread pool; the log failing to answer is a 503, not a 500."""
    try:
        return await run_in_threadpool(fn, *args, **kwargs)
    except (KafkaException, DeliveryError, TimeoutError, ConnectionError) as exc:
        raise ApiError(503, BROKER_UNAVAILABLE, f"the log did not answer: {exc}") from None
    except RuntimeError as exc:  # a reader's broker error (streams.clients.EventConsumer)
        if str(exc).startswith(("consumer ", "topic ")):
            raise ApiError(503, BROKER_UNAVAILABLE, f"the log did not answer: {exc}") from None
        raise


Name = Annotated[str, PathParam(pattern=NAME_PATTERN)]
JobId = Annotated[str, PathParam(pattern=JOB_PATTERN, description="<entitlement>.<name>")]
Wait = Annotated[bool | None, Query(description="wait for the scheduler's verdict")]
WaitS = Annotated[float, Query(ge=0, le=fe.MAX_WAIT_S, description="how long to wait at most, s")]
EntitlementQuery = Annotated[str | None, Query(pattern=NAME_PATTERN)]
AT_DESCRIPTION = ("a moment: ms since epoch, ISO-8601, now, now-DURATION (now-15m), or TOPIC/PARTITION@OFFSET "
                  "(processors/history/moments.parse_moment)")
AtQuery = Annotated[str | None, Query(min_length=1, max_length=MAX_MOMENT_CHARS, description=AT_DESCRIPTION)]
DryRun = Annotated[bool, Query(description="say what would happen; produce nothing (processors/history/whatif.py)")]
