"""The embedded Kafka cluster's pure rules (issue #26): its nodes and their ports, what a configuration asks for,
each node's server.properties, replication and min.insync.replicas, the quorum's leader from the nodes' files,
which client errors a reader asks again through, and faust's producer and changelogs. The cluster itself, killed
and caught up: tests/integration/test_replicated_log.py."""
from __future__ import annotations

import json

import pytest
from confluent_kafka import KafkaError

from infra import broker
from infra.config import BrokerNode, Config, broker_nodes, check_brokers
from streams.faustwire import IdempotentProducer, make_app
from streams.retry import transient
from streams.topics import cluster_replication_factor, min_insync_replicas, replication_config


@pytest.mark.parametrize("brokers,port,controller,nodes", [
    (1, 19092, 19093, [(1, 19092, 19093)]),
    (3, 19092, 19093, [(1, 19092, 19093), (2, 19094, 19095), (3, 19096, 19097)]),
    (3, 20000, 25000, [(1, 20000, 25000), (2, 20002, 25002), (3, 20004, 25004)]),
    (3, 20000, 20002, "overlapping ports"),  # node 2's client port is node 1's controller port
    (3, 20000, 20000, "overlapping ports"),
])
def test_broker_nodes_and_their_ports(brokers, port, controller, nodes):
    if isinstance(nodes, str):
        with pytest.raises(ValueError, match=nodes):
            broker_nodes(brokers, port, controller)
    else:
        assert broker_nodes(brokers, port, controller) == tuple(BrokerNode(*n) for n in nodes)


@pytest.mark.parametrize("brokers,ok", [(1, True), (2, False), (3, True), (5, True), (9, True), (0, False),
                                        (10, False), (-3, False)])
def test_a_cluster_has_one_node_or_a_quorum_that_survives_losing_one(brokers, ok):
    if ok:
        assert check_brokers(brokers) == brokers
    else:
        with pytest.raises(ValueError, match="brokers must be 1 or 3"):
            check_brokers(brokers)


# (environment, expected (brokers, bootstrap servers, replication factor) or the error's words)
CONFIGS = [
    ({}, (1, "127.0.0.1:19092", 1)),
    ({"ROPEWALK_BROKERS": "3"}, (3, "127.0.0.1:19092,127.0.0.1:19094,127.0.0.1:19096", 3)),
    ({"ROPEWALK_BROKERS": "5", "ROPEWALK_BROKER_PORT": "30000"},
     (5, ",".join(f"127.0.0.1:{30000 + 2 * i}" for i in range(5)), 3)),
    ({"ROPEWALK_BROKERS": "3", "ROPEWALK_REPLICATION_FACTOR": "2"}, (3, None, 2)),
    ({"ROPEWALK_BROKERS": "2"}, "ROPEWALK_BROKERS: brokers must be 1 or 3"),
    ({"ROPEWALK_BROKERS": "three"}, "ROPEWALK_BROKERS must be an integer"),
    ({"ROPEWALK_REPLICATION_FACTOR": "3"}, "ROPEWALK_REPLICATION_FACTOR must be 1..1"),
    ({"ROPEWALK_REPLICATION_FACTOR": "0"}, "ROPEWALK_REPLICATION_FACTOR must be"),
    # an external cluster: its own bootstrap servers; the replicas as asked, or (None) as many as it has brokers
    ({"ROPEWALK_BOOTSTRAP_SERVERS": "k1:9092,k2:9092,k3:9092"}, (1, "k1:9092,k2:9092,k3:9092", None)),
    ({"ROPEWALK_BOOTSTRAP_SERVERS": "k1:9092", "ROPEWALK_REPLICATION_FACTOR": "3"}, (1, "k1:9092", 3)),
]


@pytest.mark.parametrize("env,expect", CONFIGS, ids=[json.dumps(c[0]) for c in CONFIGS])
def test_what_a_configuration_asks_of_the_cluster(tmp_path, env, expect):
    env = {"ROPEWALK_RUN_DIR": str(tmp_path), **env}
    if isinstance(expect, str):
        with pytest.raises(ValueError, match=expect):
            Config.from_env(env)
        return
    cfg = Config.from_env(env)
    brokers, servers, rf = expect
    assert (cfg.brokers, cfg.replication_factor) == (brokers, rf)
    if servers is not None:
        assert cfg.bootstrap_servers == servers
    assert len(cfg.broker_nodes) == (brokers if cfg.embedded_broker else 0)


def test_a_run_directory_holding_a_cluster_names_its_nodes(tmp_path):
    """A process not told ROPEWALK_BROKERS (`status`, `down` in another shell) takes the cluster the run directory
    holds; one node formatted, or none yet: one node."""
    kafka = tmp_path / "kafka"
    assert broker.formatted_brokers(tmp_path) is None and Config.from_env({"ROPEWALK_RUN_DIR": str(tmp_path)}).brokers == 1
    kafka.mkdir()
    (kafka / broker.CLUSTER_FILE).write_text(json.dumps({"cluster_id": "c", "nodes": [{"id": i} for i in (1, 2, 3)]}))
    cfg = Config.from_env({"ROPEWALK_RUN_DIR": str(tmp_path)})
    assert broker.formatted_brokers(tmp_path) == 3 and cfg.brokers == 3 and cfg.replication_factor == 3
    assert Config.from_env({"ROPEWALK_RUN_DIR": str(tmp_path), "ROPEWALK_BROKERS": "1"}).brokers == 1  # asked: as asked
    (kafka / broker.CLUSTER_FILE).unlink()
    (kafka / "data").mkdir()
    (kafka / "data" / "meta.properties").write_text("")
    assert broker.formatted_brokers(tmp_path) == 1


def test_with_brokers_follows_with_its_servers_and_replicas(tmp_path):
    one = Config.from_env({"ROPEWALK_RUN_DIR": str(tmp_path), "ROPEWALK_BROKER_PORT": "21000"})
    three = one.with_brokers(3)
    assert (three.brokers, three.replication_factor) == (3, 3)
    assert three.bootstrap_servers == "127.0.0.1:21000,127.0.0.1:21002,127.0.0.1:21004"
    assert three.with_brokers(1) == one
    external = Config.from_env({"ROPEWALK_BOOTSTRAP_SERVERS": "k:1"})
    assert external.with_brokers(3) is external


@pytest.mark.parametrize("rf,isr", [(1, 1), (2, 1), (3, 2), (4, 3), (5, 3)])
def test_min_insync_replicas_is_a_majority_from_three_replicas(rf, isr):
    assert min_insync_replicas(rf) == isr
    assert replication_config(rf) == {"min.insync.replicas": str(isr)}


@pytest.mark.parametrize("brokers,rf", [(0, 1), (1, 1), (2, 2), (3, 3), (7, 3)])
def test_an_external_cluster_that_does_not_say_gets_one_replica_per_broker_up_to_three(brokers, rf):
    assert cluster_replication_factor(brokers) == rf


@pytest.mark.parametrize("brokers,node,expect", [
    (1, 1, {"node.id": "1", "controller.quorum.bootstrap.servers": "127.0.0.1:19093",
            "listeners": "SASL_PLAINTEXT://127.0.0.1:19092,CONTROLLER://127.0.0.1:19093",
            "default.replication.factor": "1", "min.insync.replicas": "1", "offsets.topic.replication.factor": "1",
            "transaction.state.log.replication.factor": "1", "transaction.state.log.min.isr": "1",
            "broker.session.timeout.ms": None}),
    (3, 2, {"node.id": "2",
            "controller.quorum.bootstrap.servers": "127.0.0.1:19093,127.0.0.1:19095,127.0.0.1:19097",
            "listeners": "SASL_PLAINTEXT://127.0.0.1:19094,CONTROLLER://127.0.0.1:19095",
            "advertised.listeners": "SASL_PLAINTEXT://127.0.0.1:19094",
            "default.replication.factor": "3", "min.insync.replicas": "2", "offsets.topic.replication.factor": "3",
            "transaction.state.log.replication.factor": "3", "transaction.state.log.min.isr": "2",
            "share.coordinator.state.topic.replication.factor": "3", "unclean.leader.election.enable": "false",
            "broker.session.timeout.ms": "4000", "process.roles": "broker,controller"}),
])
def test_each_node_is_a_broker_and_a_voter_replicating_everything(tmp_path, brokers, node, expect):
    cfg = Config.from_env({"ROPEWALK_RUN_DIR": str(tmp_path), "ROPEWALK_BROKERS": str(brokers)})
    layout = broker.BrokerLayout.of(cfg, node)
    props = broker.server_properties(cfg, layout, node=cfg.broker_nodes[node - 1])
    assert {k: props.get(k) for k in expect} == expect
    root = tmp_path / "kafka" if brokers == 1 else tmp_path / "kafka" / f"broker-{node}"
    assert props["log.dirs"] == str(root / "data")
    assert broker.node_name(cfg, node) == ("broker" if brokers == 1 else f"broker-{node}")


def test_the_quorum_leader_is_the_leader_of_the_highest_epoch_a_node_recorded(tmp_path):
    cfg = Config.from_env({"ROPEWALK_RUN_DIR": str(tmp_path), "ROPEWALK_BROKERS": "3"})
    assert broker.quorum_leader(cfg) is None  # no node has a file yet
    for node, (leader, epoch) in {1: (1, 4), 2: (3, 6), 3: (-1, 7)}.items():  # node 3 voting: no leader known
        state = broker.BrokerLayout.of(cfg, node).data / "__cluster_metadata-0" / "quorum-state"
        state.parent.mkdir(parents=True)
        state.write_text(json.dumps({"leaderId": leader, "leaderEpoch": epoch, "votedId": -1, "data_version": 1}))
    assert broker.quorum_leader(cfg) == 3


@pytest.mark.parametrize("code,asked_again", [
    (KafkaError._DESTROY_BROKER, True),  # the handle of a broker the metadata no longer lists
    (KafkaError._TRANSPORT, True),
    (KafkaError.NOT_LEADER_FOR_PARTITION, True),
    (KafkaError.LEADER_NOT_AVAILABLE, True),
    (KafkaError._UNKNOWN_PARTITION, True),  # the client's metadata, while the leader's node is stopped
    (KafkaError.TOPIC_AUTHORIZATION_FAILED, False),  # a refusal is not a leader's move
    (KafkaError.UNKNOWN_TOPIC_OR_PART, False),
    (KafkaError._ALL_BROKERS_DOWN, False),
])
def test_a_reader_asks_again_through_a_leaders_move_only(code, asked_again):
    assert transient(KafkaError(code)) is asked_again
    assert not transient(None)


def test_faust_produces_idempotently_and_replicates_its_changelogs(tmp_path):
    for brokers, rf in ((1, 1), (3, 3)):
        cfg = Config.from_env({"ROPEWALK_RUN_DIR": str(tmp_path), "ROPEWALK_BROKERS": str(brokers)})
        app = make_app(cfg, "unit")
        assert app.conf.topic_replication_factor == rf
        assert isinstance(app.producer, IdempotentProducer)
        assert app.producer._settings_extra() == {"acks": "all", "enable_idempotence": True}
