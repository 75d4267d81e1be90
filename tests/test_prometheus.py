"""The deploy files against a real Prometheus and a real mount: promtool accepts the scrape
configuration and the alert rules; a Prometheus on loopback scrapes a mount while files are
read, and every PromQL expression of the Grafana dashboard and of the alerts evaluates, with
the values a user of those panels should see."""

from __future__ import annotations

import json
import math
import re
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from cachefs.store.admission import FractionAdmission
from tests.conftest import REPO, make_files, shuffled_read_all, wait_for

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(shutil.which("prometheus") is None or shutil.which("promtool") is None,
                       reason="Debian's prometheus package is not installed (scripts/setup.sh "
                              "installs it)"),
]

DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "cachefs.json"
SCRAPE = DEPLOY / "prometheus" / "scrape.yml"
ALERTS = DEPLOY / "prometheus" / "cachefs-alerts.yml"
# Grafana's variables, as a dashboard showing every node over the last minute fills them in.
GRAFANA_VARIABLES = {"$instance": ".*", "$__rate_interval": "1m", "$__interval": "15s"}
FRACTION = 0.5


def dashboard_expressions() -> dict[str, str]:
    """Panel title (and target) -> PromQL, every target of every panel."""
    def panels(items):
        for item in items:
            yield item
            yield from panels(item.get("panels", []))

    found = {}
    for panel in panels(json.loads(DASHBOARD.read_text())["panels"]):
        for target in panel.get("targets", []):
            if target.get("expr"):
                found[f"{panel['title']} [{target.get('refId', '')}]"] = target["expr"]
    return found


def alert_expressions() -> dict[str, str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return {rule["alert"]: rule["expr"] for group in rules["groups"] for rule in group["rules"]}


def as_queried(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"a Grafana variable this test does not know: {expr}"
    return expr


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60,
                          cwd=cwd)


@pytest.mark.fast
def test_promtool_accepts_the_scrape_configuration_and_the_rules(tmp_path: Path):
    rules = promtool("check", "rules", str(ALERTS), cwd=tmp_path)
    assert rules.returncode == 0, rules.stdout + rules.stderr
    # The scrape configuration names the rules file next to it.
    shutil.copy(ALERTS, tmp_path / ALERTS.name)
    config = yaml.safe_load(SCRAPE.read_text())
    (tmp_path / "scrape.yml").write_text(yaml.safe_dump(config))
    checked = promtool("check", "config", "scrape.yml", cwd=tmp_path)
    if checked.returncode != 0 and "kubernetes_sd_configs" in checked.stdout + checked.stderr:
        # Debian builds Prometheus without Kubernetes discovery: check the rest as it is.
        config["scrape_configs"] = [job for job in config["scrape_configs"]
                                    if "kubernetes_sd_configs" not in job]
        (tmp_path / "scrape.yml").write_text(yaml.safe_dump(config))
        checked = promtool("check", "config", "scrape.yml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A Prometheus server on loopback scraping one target every second."""

    def __init__(self, workdir: Path, target: str) -> None:
        self.port = free_port()
        shutil.copy(ALERTS, workdir / ALERTS.name)
        # The job name the alerts select on (job=~"cachefs.*").
        (workdir / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [ALERTS.name],
            "scrape_configs": [{"job_name": "cachefs",
                                "static_configs": [{"targets": [target]}]}],
        }))
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=open(workdir / "prometheus.log", "wb"),
            start_new_session=True)

    def get(self, path: str) -> dict:
        url = f"http://127.0.0.1:{self.port}{path}"
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2):
                return True
        except OSError:
            return False

    def query(self, expr: str) -> list[dict]:
        reply = self.get("/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert reply["status"] == "success", (expr, reply)
        return reply["data"]["result"]

    def value(self, expr: str) -> float | None:
        """The single value of an expression (None when it selects nothing)."""
        result = self.query(expr)
        assert len(result) <= 1, (expr, result)
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def prometheus(tmp_path: Path):
    started: list[Prometheus] = []

    def start(target: str) -> Prometheus:
        workdir = tmp_path / "prometheus"
        workdir.mkdir()
        server = Prometheus(workdir, target)
        started.append(server)
        wait_for(server.ready, timeout=30, what="prometheus to be ready")
        return server

    yield start
    for server in started:
        server.stop()


def test_every_dashboard_and_alert_expression_shows_what_the_mount_did(
        source, remote, mount_cachefs, prometheus):
    rels = make_files(source, 60, size=(1000, 60_000))
    sizes = {rel: (source / rel).stat().st_size for rel in rels}
    mount = mount_cachefs(remote.path, fraction=FRACTION)
    server = prometheus(urllib.parse.urlsplit(mount.metrics_url).netloc)
    want = {rel: (source / rel).read_bytes() for rel in rels}
    # Scraped once before any read, so that rates and increases have a start.
    wait_for(lambda: server.value("sum(cachefs_file_opens_total)") == 0, timeout=30,
             what="a scrape before the reads")
    for seed in (1, 2):  # the first pass fills the cache, the second hits what it kept
        assert shuffled_read_all(mount.path, rels, seed=seed, drop_pages=True) == want
    opens = 2 * len(rels)
    wait_for(lambda: server.value("sum(cachefs_file_opens_total)") == opens, timeout=30,
             what="a scrape after the reads")

    kept = sum(map(FractionAdmission(FRACTION).eligible, rels))
    assert 0 < kept < len(rels)
    values = {}
    for name, expr in {**dashboard_expressions(), **alert_expressions()}.items():
        result = server.query(as_queried(expr))  # every expression evaluates
        for sample in result:
            number = float(sample["value"][1])
            assert math.isnan(number) or number >= 0, (name, sample)
        values[name] = [float(s["value"][1]) for s in result]

    # A healthy mount fires no alert.
    for alert in alert_expressions():
        assert values[alert] == [], alert
    # The panels a user reads: every file opened twice, the kept ones hit the second time.
    assert values["File hit ratio (1 h) [A]"] == [pytest.approx(kept / opens, abs=0.01)]
    assert values["Remotes answering [A]"] == [1.0]
    assert values["Remotes answering [B]"] == [1.0]
    assert values["Files cached, admitting [A]"] == [kept]
    assert values["Files cached, admitting [B]"] == [1.0]
    passthrough = mount.status()["data_path"].startswith("kernel passthrough")
    assert values["Mounts read by kernel passthrough [A]"] == [1.0 if passthrough else 0.0]
    assert values["Mounts read by kernel passthrough [B]"] == [1.0]
    fill = values["Cache fill [A]"][0]
    assert 0 < fill < 1
    # Bytes by source add up to every byte read, and the floor is (1 - f) of them.
    total = sum(sizes.values()) * 2
    assert server.value("sum(cachefs_read_bytes_total)") == total
    by_source = server.query('sum by (source) (cachefs_read_bytes_total)')
    assert sum(float(s["value"][1]) for s in by_source) == total
    kept_bytes = sum(size for rel, size in sizes.items()
                     if FractionAdmission(FRACTION).eligible(rel))
    assert server.value('sum(cachefs_read_bytes_total{source="cache"})') == kept_bytes
    assert server.value("1 - avg(cachefs_admission_fraction)") == 1 - FRACTION
    assert server.value("sum(cachefs_remote_read_bytes_total)") == total - kept_bytes


def test_every_metric_the_dashboard_and_alerts_name_exists_in_a_real_scrape(
        source, remote, mount_cachefs, tmp_path):
    make_files(source, 3, size=1000)
    # A node of a cluster (its peer is down), so that the peer metrics have series too.
    me, peer = (f"127.0.0.1:{free_port()}" for _ in range(2))
    secret = tmp_path / "peer.secret"
    secret.write_bytes(b"s" * 32)
    secret.chmod(0o600)
    mount = mount_cachefs(remote.path, peers=f"{me},{peer}", peer_listen=me,
                          peer_secret_file=secret)

    def scrape() -> set[str]:
        with urllib.request.urlopen(mount.metrics_url, timeout=10) as response:
            return {line.split("{")[0].split(" ")[0]
                    for line in response.read().decode().splitlines()
                    if line and not line.startswith("#")}

    scraped = wait_for(lambda: (names := scrape()) and "cachefs_peer_up" in names and names,
                       timeout=20, what="the first health check of the peer")
    named = {name for expr in [*dashboard_expressions().values(),
                               *alert_expressions().values()]
             for name in re.findall(r"\bcachefs_\w+", expr)}
    assert named, "no cachefs metric found in the deploy files"
    assert sorted(named - scraped) == []
