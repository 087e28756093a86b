"""tenancy/trust.py: the pure checks of what a tenant's dataset, reward URL and resumeFrom may
reach. The engine-level attacks on a real engine process are in test_tenant_boundaries.py."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from loraplex_engine.spec.errors import TaskError, UsageError
from loraplex_engine.tenancy.trust import (
    DataRoots,
    RewardEgress,
    TrustPolicy,
    checkpoint_inside,
    forbidden_reason,
    parse_allowed_host,
)


@pytest.fixture()
def roots(tmp_path: Path) -> Path:
    for ns in ("team-a", "team-b"):
        (tmp_path / "data" / ns).mkdir(parents=True)
        (tmp_path / "data" / ns / "x.jsonl").write_text('{"prompt": "p", "answer": "a"}\n')
    return tmp_path / "data"


def _refusal(data: DataRoots, dataset: str, namespace: str = "team-a") -> str:
    with pytest.raises(TaskError) as info:
        data.resolve(dataset, namespace)
    assert info.value.field == "spec.task.dataset"
    return info.value.message


def test_a_dataset_resolves_inside_its_namespace_directory(roots: Path) -> None:
    data = DataRoots((roots,))
    own = roots / "team-a" / "x.jsonl"
    assert data.resolve("x.jsonl", "team-a") == (own, roots / "team-a")
    assert data.resolve(str(own), "team-a")[0] == own
    assert data.resolve("sub/new.jsonl", "team-a")[0] == roots / "team-a" / "sub" / "new.jsonl"


def test_another_namespaces_file_is_refused_the_same_whether_it_exists_or_not(
    roots: Path,
) -> None:
    data = DataRoots((roots,))
    (roots / "team-b" / "bad.jsonl").write_text("not json\n")
    texts = {
        _refusal(data, str(roots / "team-b" / name)).replace(name, "NAME")
        for name in ("x.jsonl", "nope.jsonl", "bad.jsonl")
    }
    assert len(texts) == 1 and "not allowed" in texts.pop()
    for sneaky in ("../team-b/x.jsonl", "/etc/passwd", str(roots / "team-a"), "."):
        assert "not allowed" in _refusal(data, sneaky)


def test_a_symlink_out_of_the_namespace_directory_is_refused(roots: Path) -> None:
    link = roots / "team-a" / "link.jsonl"
    link.symlink_to(roots / "team-b" / "x.jsonl")
    loop = roots / "team-a" / "loop.jsonl"
    loop.symlink_to(loop)
    data = DataRoots((roots,))
    assert "not allowed" in _refusal(data, "link.jsonl")
    assert "not allowed" in _refusal(data, "loop.jsonl")
    assert not DataRoots.inside(link, roots / "team-a")


def test_no_data_root_refuses_every_dataset_naming_the_flag(roots: Path) -> None:
    message = _refusal(TrustPolicy().data, str(roots / "team-a" / "x.jsonl"))
    assert "--data-root" in message and "no data root" in message


def test_the_local_runner_takes_files_anywhere_under_its_root(roots: Path) -> None:
    data = TrustPolicy.local([roots]).data
    assert data.resolve("team-b/x.jsonl", "default")[0] == roots / "team-b" / "x.jsonl"
    assert "run --data-root" in _refusal(TrustPolicy.local([]).data, "x.jsonl")
    assert "not allowed" in _refusal(data, "/etc/passwd")


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("127.0.0.1", "loopback"),
        ("127.8.9.10", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),
        ("169.254.169.254", "metadata"),
        ("fe80::1", "link-local"),
        ("fd00:ec2::254", "metadata"),
        ("100.100.100.200", "metadata"),
        ("0.0.0.0", "unspecified"),
        ("0.1.2.3", "unspecified"),
        ("::", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("10.1.2.3", "own"),
    ],
)
def test_local_and_metadata_addresses_are_forbidden(address: str, reason: str) -> None:
    own = [ipaddress.ip_address("10.1.2.3")]
    assert reason in str(forbidden_reason(ipaddress.ip_address(address), own))


# IPv6 spellings of an IPv4 address (issue 26, item 7): IPv4-compatible ::/96, mapped
# ::ffff:0:0/96, NAT64 64:ff9b::/96, 6to4 2002::/16 and Teredo (client XOR-ed).
@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("::127.0.0.1", "loopback"),
        ("::7f00:1", "loopback"),
        ("::169.254.169.254", "metadata"),
        ("::ffff:169.254.169.254", "metadata"),
        ("64:ff9b::a9fe:a9fe", "metadata"),
        ("64:ff9b::127.0.0.1", "loopback"),
        ("64:ff9b::0.0.0.0", "unspecified"),
        ("64:ff9b::100.100.100.200", "metadata"),
        ("2002:a9fe:a9fe::", "metadata"),
        ("2002:7f00:1::1", "loopback"),
        ("2002:a01:203::", "own"),
        ("::10.1.2.3", "own"),
        ("2001:0:4136:e378:8000:63bf:80ff:fffe", "loopback"),
    ],
)
def test_ipv6_forms_are_judged_by_the_ipv4_address_inside(address: str, reason: str) -> None:
    own = [ipaddress.ip_address("10.1.2.3")]
    assert reason in str(forbidden_reason(ipaddress.ip_address(address), own))


@pytest.mark.parametrize(
    "address",
    [
        "10.96.0.12",
        "8.8.8.8",
        "192.168.1.5",
        "2001:db8::1",
        "64:ff9b::8.8.8.8",
        "2002:808:808::1",
        "::ffff:10.96.0.12",
    ],
)
def test_other_addresses_are_allowed(address: str) -> None:
    assert (
        forbidden_reason(ipaddress.ip_address(address), [ipaddress.ip_address("10.1.2.3")]) is None
    )


def _egress(table: dict[str, list[str]], hosts: tuple[str, ...] = (), port: int | None = 8000):
    return RewardEgress.build(hosts, ["10.1.2.3"], own_port=port, resolver=lambda h, p: table[h])


def _egress_refusal(egress: RewardEgress, url: str) -> str:
    with pytest.raises(TaskError) as info:
        egress.check(url)
    assert info.value.field == "spec.task.rewardUrl"
    return info.value.message


def test_reward_urls_to_local_addresses_are_refused_unless_the_host_is_listed() -> None:
    table = {"localhost": ["127.0.0.1", "::1"], "127.0.0.1": ["127.0.0.1"], "pod": ["10.1.2.3"]}
    table |= {"169.254.169.254": ["169.254.169.254"], "mixed.test": ["8.8.8.8", "127.0.0.1"]}
    egress = _egress(table)
    assert "loopback" in _egress_refusal(egress, "http://localhost:9000/score")
    assert "loopback" in _egress_refusal(egress, "http://127.0.0.1:9000/score")
    assert "metadata" in _egress_refusal(egress, "http://169.254.169.254/latest/meta-data")
    assert "own addresses" in _egress_refusal(egress, "http://pod:9000/score")
    assert "loopback" in _egress_refusal(egress, "http://mixed.test/score")  # any answer
    listed = _egress(table, hosts=("127.0.0.1",))
    target = listed.check("http://127.0.0.1:9000/score?x=1")
    assert target is not None and target.pinned_url == "http://127.0.0.1:9000/score?x=1"
    assert "loopback" in _egress_refusal(listed, "http://localhost:9000/score")  # not listed


def test_reward_urls_with_ipv4_inside_ipv6_literals_are_refused() -> None:
    egress = RewardEgress.build(["127.0.0.1:9000"], ["10.1.2.3"], own_port=8000)  # real DNS
    for url, why in {
        "http://[::127.0.0.1]:9000/": "loopback",
        "http://[::ffff:127.0.0.1]:9000/": "loopback",
        "http://[64:ff9b::a9fe:a9fe]/latest/meta-data/": "metadata",
        "http://[2002:a9fe:a9fe::]/latest/meta-data/": "metadata",
        "http://[::10.1.2.3]:8000/v1/experiments": "own port",
    }.items():
        assert why in _egress_refusal(egress, url), url


@pytest.mark.parametrize(
    ("entry", "parsed"),
    [
        ("127.0.0.1:9000", ("127.0.0.1", 9000)),
        ("[::1]:9000", ("::1", 9000)),
        ("Rewards.Test.:443", ("rewards.test", 443)),
        ("rewards.test", ("rewards.test", None)),  # the older form: every port
        ("::1", ("::1", None)),
        ("[::1]", ("::1", None)),
    ],
)
def test_allowed_reward_hosts_take_a_port(entry: str, parsed: tuple[str, int | None]) -> None:
    assert parse_allowed_host(entry) == parsed


@pytest.mark.parametrize("entry", ["h:abc", "h:0", "h:65536", "h:", ":80", "[::1", "[::1]x"])
def test_a_bad_allowed_reward_host_is_a_usage_error(entry: str) -> None:
    with pytest.raises(UsageError, match="--allow-reward-host"):
        RewardEgress.build([entry])


def test_a_listed_host_and_port_opens_that_port_alone() -> None:
    table = {"127.0.0.1": ["127.0.0.1"], "::1": ["::1"], "rewards.test": ["127.0.0.1"]}
    egress = _egress(table, hosts=("127.0.0.1:9000", "[::1]:9000", "rewards.test:80"))
    assert egress.check("http://127.0.0.1:9000/score") is not None
    assert egress.check("http://[::1]:9000/score") is not None
    assert egress.check("http://rewards.test/score") is not None  # the scheme's port
    for url in ("http://127.0.0.1:9001/", "http://[::1]:22/", "https://rewards.test/"):
        assert "loopback" in _egress_refusal(egress, url), url
    # The older bare form still opens every port of that host (existing pools use it).
    bare = _egress(table, hosts=("127.0.0.1",))
    assert bare.check("http://127.0.0.1:9001/") is not None
    assert "own port" in _egress_refusal(bare, "http://127.0.0.1:8000/")


def test_the_engines_own_port_is_refused_even_for_a_listed_host() -> None:
    table = {"127.0.0.1": ["127.0.0.1"], "pod": ["10.1.2.3"], "far.test": ["8.8.8.8"]}
    listed = _egress(table, hosts=("127.0.0.1", "pod"))
    assert "own port" in _egress_refusal(listed, "http://127.0.0.1:8000/v1/experiments")
    assert "own port" in _egress_refusal(listed, "http://pod:8000/metrics")
    assert listed.check("http://far.test:8000/score") is not None  # elsewhere, same port


def test_a_checked_target_pins_the_address_and_keeps_the_names() -> None:
    egress = _egress({"rewards.team-a.svc": ["10.96.0.12"], "v6.test": ["2001:db8::1"]})
    target = egress.check("https://rewards.team-a.svc/score")
    assert target is not None
    assert target.pinned_url == "https://10.96.0.12:443/score"
    assert (target.host_header, target.sni_hostname) == ("rewards.team-a.svc", "rewards.team-a.svc")
    v6 = egress.check("http://v6.test:81/s")
    assert v6 is not None and v6.pinned_url == "http://[2001:db8::1]:81/s"


def test_an_unresolvable_host_passes_admission_but_no_request() -> None:
    def no_dns(host: str, port: int) -> list[str]:
        raise OSError("no such host")

    egress = RewardEgress.build(resolver=no_dns)
    assert egress.check("http://later.test/score", resolve_required=False) is None
    assert "does not resolve" in _egress_refusal(egress, "http://later.test/score")


def test_resume_from_must_lie_in_the_experiments_own_directory(tmp_path: Path) -> None:
    own = tmp_path / "team-a" / "x"
    (own / "run" / "step-00000002").mkdir(parents=True)
    (tmp_path / "team-b" / "good" / "run" / "step-00000002").mkdir(parents=True)
    inside = own / "run" / "step-00000002"
    assert checkpoint_inside(inside, own) == inside
    assert checkpoint_inside(tmp_path / "team-b" / "good" / "run" / "step-00000002", own) is None
    assert checkpoint_inside(own / ".." / "xy" / "run", own) is None
    assert checkpoint_inside(own, own) is None
    link = own / "run" / "step-00000009"
    link.symlink_to(tmp_path / "team-b" / "good" / "run" / "step-00000002")
    assert checkpoint_inside(link, own) is None
