"""The Grafana dashboard and the Prometheus rules of deploy/ (deploy/grafana, deploy/prometheus).

Without a server: the dashboard's shape (its datasource a template variable), that every metric a
panel or a rule names is one our services export, and every label it groups by, matches or shows in a
legend one those metrics carry (a wrong label still returns data, one unlabelled series). With
Debian's `promtool`: the rules and the scrape config pass its checks, and the alert cases of
`rules.test.yaml` pass (and fail on a weakened rule).
With a real `prometheus`: it moves to another port when its port was taken; and on the local stack
(`ppd-up` with KV events and the SLO controller on) under a few streamed conversations, every panel's
query returns data and every rule evaluates without error.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from bench_routers.targets import free_port
from decision_service.metrics import DecisionMetrics
from devstack.ready import parse_ready_line
from gateway.metrics import GatewayMetrics
from tests.support.ci import require_tool
from tests.support.polling import wait_until
from tests.support.prometheus_server import PrometheusServer

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "ppd-router.json"
PROMETHEUS = REPO / "deploy" / "prometheus"
RULES = PROMETHEUS / "rules.yaml"
RULE_CASES = PROMETHEUS / "rules.test.yaml"
SCRAPE_CONFIG = PROMETHEUS / "prometheus.yml"
TABLES = REPO / "tables" / "example"
OPERATE = REPO / "docs/guides/operate.md"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"

#: Grafana's interval variables, as a query over the last few minutes sees them.
GRAFANA_INTERVALS = re.compile(
    r"\$(__rate_interval|__interval|__range)\b|\$\{(__rate_interval|__interval|__range)\}"
)
METRIC = re.compile(r"\b(ppd_[a-z0-9_]+)")
BY = re.compile(r"\bby \(([^)]*)\)")
SELECTOR = re.compile(r"\{([^{}]*)\}")
MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")
LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def _dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return loaded


def _panels() -> list[dict[str, Any]]:
    """Every panel that shows data (rows' nested panels included, rows themselves not)."""
    out: list[dict[str, Any]] = []
    for panel in _dashboard()["panels"]:
        if panel["type"] == "row":
            out += panel.get("panels", [])
        else:
            out.append(panel)
    return out


def _concrete(expr: str, window: str = "1m") -> str:
    """A panel's query as Grafana sends it, its interval variables replaced by `window`."""
    return GRAFANA_INTERVALS.sub(window, expr)


def _rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text(encoding="utf-8"))["groups"]
    return [rule for group in groups for rule in group["rules"]]


def _alerts() -> list[dict[str, Any]]:
    return [rule for rule in _rules() if "alert" in rule]


def _exported() -> dict[str, set[str]]:
    """Every sample name our services' registries export (counters with _total, histograms' parts),
    with its label names (as tools/docs/refgen/metrics.py reads them for docs/reference/metrics.md)."""
    names: dict[str, set[str]] = {}
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "info": ("_info",)}
    for registry in (GatewayMetrics().registry, DecisionMetrics().registry):
        for collector in registry._collector_to_names:
            name, kind = str(getattr(collector, "_name", "")), str(getattr(collector, "_type", ""))
            labels = set(getattr(collector, "_labelnames", ()))
            for suffix in suffixes.get(kind, ("",)):
                names[name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return names


# --- the files themselves -------------------------------------------------------------------------


def test_the_dashboards_datasource_is_a_template_variable_used_by_every_panel_and_query() -> None:
    dashboard = _dashboard()
    (variable,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert (variable["name"], variable["query"]) == ("datasource", "prometheus")
    uses = "${datasource}"
    for panel in _panels():
        assert panel["datasource"]["uid"] == uses, panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == uses, panel["title"]
            assert "$" not in _concrete(target["expr"]), f"unknown variable in {target['expr']!r}"
    rows = [p for p in dashboard["panels"] if p["type"] == "row"]
    ids = [p["id"] for p in rows + _panels()]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    assert all(p["title"] and p["description"] for p in _panels())


def test_every_metric_the_dashboard_and_the_rules_name_is_one_our_services_export() -> None:
    exported = _exported()
    queries = [t["expr"] for p in _panels() for t in p["targets"]] + [r["expr"] for r in _rules()]
    named = {name for expr in queries for name in METRIC.findall(expr)}
    assert named, "no metric found in the queries"
    assert named <= exported.keys(), f"not exported by our services: {sorted(named - exported.keys())}"
    # The sections the dashboard promises operators.
    for needed in (
        "ppd_gateway_decisions_total", "ppd_gateway_time_to_first_token_seconds_bucket",
        "ppd_gateway_time_per_output_token_seconds_bucket", "ppd_gateway_sessions",
        "ppd_gateway_kv_tracked_blocks", "ppd_gateway_slo_w_tpot", "ppd_gateway_route_rpc_seconds_bucket",
        "ppd_gateway_decision_fallbacks_total", "ppd_decisions_total", "ppd_gateway_workers",
    ):  # fmt: skip
        assert needed in named, f"the dashboard shows nothing of {needed}"


def test_every_label_a_query_groups_by_matches_or_shows_is_one_its_metrics_carry() -> None:
    exported = _exported()
    queries = [(t["expr"], t["legendFormat"]) for p in _panels() for t in p["targets"]]
    queries += [(r["expr"], "") for r in _rules()]
    for expr, legend in queries:
        carried = {"instance", "job"}.union(*(exported[name] for name in METRIC.findall(expr)))
        used = {label.strip() for group in BY.findall(expr) for label in group.split(",")}
        used |= {m for selector in SELECTOR.findall(expr) for m in MATCHER.findall(selector)}
        used |= set(LEGEND.findall(legend))
        assert used <= carried, f"{expr!r} names labels its metrics do not carry: {sorted(used - carried)}"


def test_every_alert_has_a_summary_a_description_a_firing_case_and_a_runbook_entry() -> None:
    cases = yaml.safe_load(RULE_CASES.read_text(encoding="utf-8"))
    firing = {
        check["alertname"]
        for case in cases["tests"]
        for check in case.get("alert_rule_test", [])
        if check.get("exp_alerts")
    }
    runbook = OPERATE.read_text(encoding="utf-8")
    for rule in _alerts():
        name = rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert rule["annotations"]["summary"], name
        assert f"Runbook: docs/guides/operate.md, {name}." in rule["annotations"]["description"], name
        assert name in firing, f"{name} has no case in rules.test.yaml where it fires"
        assert f"**`{name}`**" in runbook, f"docs/guides/operate.md has no runbook entry for {name}"


def test_the_scrape_config_names_the_jobs_the_rules_expect() -> None:
    config = yaml.safe_load(SCRAPE_CONFIG.read_text(encoding="utf-8"))
    assert config["rule_files"] == ["rules.yaml"]
    assert [job["job_name"] for job in config["scrape_configs"]] == ["ppd-gateway", "ppd-decision"]
    (target_down,) = [r for r in _alerts() if r["alert"] == "PPDTargetDown"]
    assert 'job=~"ppd-gateway|ppd-decision"' in target_down["expr"]


# --- promtool ---------------------------------------------------------------------------------------


def _promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    require_tool("promtool", "the rule checks run Prometheus' own promtool (make prometheus)")
    return subprocess.run(
        ["promtool", *map(str, args)], capture_output=True, text=True, timeout=120, check=False
    )


def test_the_rules_and_the_scrape_config_pass_promtool_check() -> None:
    rules = _promtool("check", "rules", RULES)
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in rules.stdout
    config = _promtool("check", "config", SCRAPE_CONFIG)
    assert config.returncode == 0, config.stdout + config.stderr


def test_the_alert_cases_pass_promtool_test_rules() -> None:
    result = _promtool("test", "rules", RULE_CASES)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_the_alert_cases_fail_when_a_rule_no_longer_fires(tmp_path: Path) -> None:
    # A fast burn threshold of 60x the budget (more than all turns failing) can never fire.
    weakened = RULES.read_text(encoding="utf-8").replace("> 14.4 * 0.01", "> 60 * 0.01")
    assert weakened != RULES.read_text(encoding="utf-8")
    (tmp_path / "rules.yaml").write_text(weakened, encoding="utf-8")
    (tmp_path / "rules.test.yaml").write_text(RULE_CASES.read_text(encoding="utf-8"), encoding="utf-8")
    result = _promtool("test", "rules", tmp_path / "rules.test.yaml")
    assert result.returncode != 0
    assert "alertname: PPDTTFTSLOFastBurn" in result.stdout + result.stderr


# --- a real Prometheus ------------------------------------------------------------------------------


def _scrape_config(folder: Path, gateway: str, decision_metrics: str, interval: str = "2s") -> Path:
    """The shipped scrape config with these targets, scraping and evaluating every `interval` (also
    each scrape's timeout: a busy 2-core machine can take over a second to answer one, and a failed
    scrape makes every gauge of that target stale, gone from instant queries until the next one)."""
    config = yaml.safe_load(SCRAPE_CONFIG.read_text(encoding="utf-8"))
    config["global"] = {"scrape_interval": interval, "evaluation_interval": interval}
    config["rule_files"] = [str(RULES)]
    targets = {"ppd-gateway": [gateway], "ppd-decision": [decision_metrics]}
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
    path = folder / "prometheus.yml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


@contextmanager
def _prometheus(config: Path, **options: Any) -> Iterator[PrometheusServer]:
    server = PrometheusServer.start(config, **options)
    try:
        yield server
    finally:
        server.close()


@pytest.mark.integration
def test_prometheus_moves_to_another_port_when_its_port_was_taken(tmp_path: Path) -> None:
    config = _scrape_config(tmp_path, "127.0.0.1:9", "127.0.0.1:9")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        ports = iter([taken, free_port()])
        with _prometheus(config, ports=lambda: next(ports)) as server:
            assert server.lost_ports == (taken,)
            assert server.port != taken
            assert server.get("/api/v1/status/runtimeinfo")["storageRetention"]
        with pytest.raises(
            AssertionError, match=f"found every port it was given taken \\({taken}, {taken}\\)"
        ):
            PrometheusServer.start(config, ports=lambda: taken, tries=2)


@pytest.mark.integration
def test_prometheus_on_a_bad_config_fails_with_its_own_words(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text("scrape_configs:\n  - job_name: x\n    scrape_interval: soon\n", encoding="utf-8")
    with pytest.raises(
        AssertionError, match=r"exited with 2 before it was ready: .*not a valid duration string: .*soon"
    ):
        PrometheusServer.start(bad)


@asynccontextmanager
async def _stack(log: Path) -> AsyncIterator[dict[str, Any]]:
    """`ppd-up` on the example tables with KV events and the SLO controller on; its ready line."""
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "devstack.stack", "--port", "0", "--tables", str(TABLES),
            "--log-level", "WARNING", "--ready-timeout", "110", "--kv-events", "--slo-ttft-p99-ms", "500",
            cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=err,
        )  # fmt: skip
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(150):  # three services starting on a busy 2-core machine
            line = await proc.stdout.readline()
        if not line:
            said = await asyncio.to_thread(log.read_text, errors="replace")
            pytest.fail(f"ppd-up exited before it was ready: {said[-2000:]}")
        yield parse_ready_line(line)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(60):
            await proc.communicate()


async def _conversation(http: aiohttp.ClientSession, url: str, n: int, turns: int = 3) -> list[str]:
    """A streamed multi-turn conversation (the gateway times streams: TTFT, TPOT); each turn's path."""
    messages = [{"role": "user", "content": f"Tell me about river number {n}."}]
    paths = []
    for _ in range(turns):
        body = {"model": MODEL, "messages": messages, "max_tokens": 16, "stream": True}
        async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            paths.append(resp.headers["X-PPD-Path"])
            parts = []
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    parts += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
        messages += [
            {"role": "assistant", "content": "".join(parts)},
            {"role": "user", "content": "And then?"},
        ]
    return paths


def _without_data(server: PrometheusServer) -> list[str]:
    """The panels (and queries) with no data yet."""
    return [
        f"{panel['title']}: {_concrete(target['expr'])}"
        for panel in _panels()
        for target in panel["targets"]
        if not server.query(_concrete(target["expr"]))
    ]


def _unhealthy_rules(server: PrometheusServer) -> list[str]:
    """Rules not yet evaluated or evaluated with an error, and the count check (all of them loaded)."""
    loaded = [rule for group in server.get("/api/v1/rules")["groups"] for rule in group["rules"]]
    if len(loaded) != len(_rules()):
        return [f"{len(loaded)} of {len(_rules())} rules loaded"]
    return [f"{r['name']}: {r['health']} {r.get('lastError', '')}" for r in loaded if r["health"] != "ok"]


@pytest.mark.integration
async def test_every_dashboard_panel_has_data_from_the_local_stack_under_load(tmp_path: Path) -> None:
    require_tool("prometheus", "this test scrapes the local stack with a real Prometheus (make prometheus)")
    async with _stack(tmp_path / "ppd-up.log") as ready:
        gateway = ready["gateway"].removeprefix("http://")
        config = _scrape_config(tmp_path, gateway, f"127.0.0.1:{ready['decision']['metrics']}")
        server = await asyncio.to_thread(PrometheusServer.start, config)
        try:

            def targets_up() -> bool:
                targets = server.targets()
                return len(targets) == 2 and all(t["health"] == "up" for t in targets)

            await asyncio.to_thread(
                wait_until, targets_up, deadline_s=60, what="both scrape targets up", poll_s=0.2
            )
            async with aiohttp.ClientSession() as http:
                paths = await asyncio.gather(*(_conversation(http, ready["gateway"], n) for n in range(4)))
            assert all(p[0] == "pd" for p in paths)  # Turn 1 always P/D; Turn 2+ as the table says

            def missing() -> list[str]:
                # The SLO recording rule too: it saw the streamed turns.
                recorded = server.query("ppd:gateway_ttft_slo_attainment:ratio_rate5m")
                return (
                    _without_data(server)
                    + _unhealthy_rules(server)
                    + ([] if recorded else ["no TTFT SLO record"])
                )

            try:
                # One round of queries a second: dozens of them, on a 2-core machine.
                await asyncio.to_thread(
                    wait_until, lambda: not missing(), deadline_s=60, what="data", poll_s=1.0
                )
            except AssertionError:
                scrapes = [f"{t['scrapeUrl']}: {t['health']} {t['lastError']}" for t in server.targets()]
                pytest.fail(
                    "panels without data or rules unhealthy after 60 s:\n"
                    + "\n".join(missing())
                    + "\nscrapes:\n"
                    + "\n".join(scrapes)
                    + f"\nprometheus' log:\n{server.log_tail()}"
                )
        finally:
            await asyncio.to_thread(server.close)
