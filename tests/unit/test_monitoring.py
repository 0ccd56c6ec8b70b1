"""ops/monitoring: the Prometheus rules, their promtool tests, the scrape config and the Grafana dashboard.

* promtool checks the rule file and the configuration, and runs the rules' unit tests
  (``alerts_test.yml``); skipped, with the reason, where promtool is not installed.
* Every metric name a rule or a dashboard panel queries is one the code exports: the
  prometheus_client metric objects of ``workers.metrics`` and ``ingest.metrics`` (as the
  exposition names their samples: a Counter ``x`` is ``x_total``, a Histogram ``x`` is
  ``x_bucket``, ``x_sum``, ``x_count``) and the metric families ``LedgerCollector`` yields (read
  from its source: collecting them needs a database). A renamed or misspelled metric would
  otherwise silence an alert without any error.
* Every alert is labelled and annotated, and tested both firing and quiet; the dashboard
  loads, its panel ids are unique and every query goes to the datasource uid ``prometheus``.
"""
from __future__ import annotations

import importlib
import inspect
import json
import re
import shutil
import subprocess
import unicodedata
from pathlib import Path

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "ops" / "monitoring"
RULES = MONITORING / "alerts.yml"
RULE_TESTS = MONITORING / "alerts_test.yml"
PROMETHEUS_CONFIG = MONITORING / "prometheus.yml"
DASHBOARD = MONITORING / "grafana" / "dashboard.json"
DATASOURCES = MONITORING / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS = MONITORING / "grafana" / "provisioning" / "dashboards" / "ledger.yml"
DOCS = ROOT / "docs"

METRIC_MODULES = ("workers.metrics", "ingest.metrics")
DATASOURCE_UID = "prometheus"
SEVERITIES = {"page", "ticket"}


# -- what the code exports ----------------------------------------------------------------------

# The sample names the text exposition gives each metric type (prometheus_client's naming).
SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "enum": ("",),
    "unknown": ("",),
}
FAMILY_TYPES = {"Counter": "counter", "Gauge": "gauge", "Histogram": "histogram", "Summary": "summary",
                "Info": "info", "StateSet": "stateset", "Unknown": "unknown", "GaugeHistogram": "gaugehistogram"}
# prometheus_client.core.GaugeMetricFamily("name", ...) and its siblings, as LedgerCollector.collect yields them.
FAMILY_CALL = re.compile(r"\b(" + "|".join(sorted(FAMILY_TYPES, key=len, reverse=True)) +
                         r")MetricFamily\(\s*[\"']([a-zA-Z_:][a-zA-Z0-9_:]*)[\"']")


def sample_names(name: str, metric_type: str) -> set[str]:
    if metric_type == "counter":
        name = name.removesuffix("_total")  # as prometheus_client does for Counter names
    return {name + suffix for suffix in SAMPLE_SUFFIXES[metric_type]}


def module_metric_objects() -> list[MetricWrapperBase]:
    found = []
    for module_name in METRIC_MODULES:
        module = importlib.import_module(module_name)
        found.extend(value for value in vars(module).values() if isinstance(value, MetricWrapperBase))
    return found


def collector_families() -> list[tuple[str, str]]:
    """(name, type) of every metric family LedgerCollector.collect yields, read from its source."""
    from workers.metrics import LedgerCollector

    source = inspect.getsource(LedgerCollector)
    return [(name, FAMILY_TYPES[kind]) for kind, name in FAMILY_CALL.findall(source)]


def exported_names() -> set[str]:
    names: set[str] = set()
    for metric in module_metric_objects():
        for family in metric.describe():
            names |= sample_names(family.name, family.type)
    for name, metric_type in collector_families():
        names |= sample_names(name, metric_type)
    return names


# -- what the rules and the dashboard query -----------------------------------------------------

KEYWORDS = {"and", "or", "unless", "atan2", "by", "without", "on", "ignoring", "group_left", "group_right",
            "offset", "bool", "inf", "nan"}
_STRING = re.compile(r"\"(?:\\.|[^\"\\])*\"|'(?:\\.|[^'\\])*'|`[^`]*`")
_TEMPLATE_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[\w+\]\]")
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_TOKEN = re.compile(r"(?P<number>0[xX][0-9a-fA-F]+|\d[\w.]*|\.\d[\w.]*)"
                    r"|(?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<call>\s*\()?")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (Grafana's $variables allowed)."""
    assert "__name__" not in expr, f"selects by __name__, which this check cannot read: {expr}"
    text = _TEMPLATE_VARIABLE.sub(" ", expr)
    text = _STRING.sub('""', text)
    text = _MATCHERS.sub(" ", text)      # label matchers: label names, not metrics
    text = _RANGE.sub(" ", text)         # [5m], [1h:1m]
    text = _LABEL_LIST.sub(" ", text)    # by (le), on (type), group_left (x)
    names = set()
    for token in _TOKEN.finditer(text):
        name = token.group("ident")
        if name is None or token.group("call") or name.lower() in KEYWORDS:
            continue  # a number or a duration, a function or aggregation, a keyword
        names.add(name)
    return names


def load_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def alerts() -> list[dict]:
    return [rule for rule in load_rules() if "alert" in rule]


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels(panels=None) -> list[dict]:
    """Every panel, those inside collapsed rows included."""
    found = []
    for panel in load_dashboard()["panels"] if panels is None else panels:
        found.append(panel)
        found.extend(dashboard_panels(panel.get("panels", [])))
    return found


def dashboard_targets() -> list[tuple[str, dict]]:
    return [(panel.get("title", ""), target) for panel in dashboard_panels() for target in panel.get("targets", [])]


def queried_expressions() -> list[tuple[str, str]]:
    """(where, PromQL) for every rule and every dashboard query."""
    exprs = [(f"alerts.yml {rule.get('alert') or rule.get('record')}", rule["expr"]) for rule in load_rules()]
    exprs += [(f"dashboard.json panel {title!r} {target.get('refId', '')}", target["expr"])
              for title, target in dashboard_targets()]
    return exprs


# -- promtool -----------------------------------------------------------------------------------

def promtool(*args: str) -> subprocess.CompletedProcess:
    executable = shutil.which("promtool")
    if executable is None:
        pytest.skip("promtool not installed (Debian/Ubuntu: apt-get install prometheus)")
    return subprocess.run([executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_promtool_accepts_the_rules():
    result = promtool("check", "rules", str(RULES.relative_to(ROOT)))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_accepts_the_prometheus_config_and_finds_the_rules():
    result = promtool("check", "config", str(PROMETHEUS_CONFIG.relative_to(ROOT)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout, result.stdout


def test_the_rules_pass_their_promtool_unit_tests():
    result = promtool("test", "rules", str(RULE_TESTS.relative_to(ROOT)))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_prometheus_config_loads_the_rule_file_and_scrapes_the_compose_services():
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert config["rule_files"] == ["alerts.yml"]
    targets = {}
    for job in config["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            targets[job["job_name"]] = (sd["names"], sd["port"])
    assert targets["receiver"] == (["receiver"], 8000)
    assert targets["worker"][0] == ["worker"]
    assert targets["sweep"][0] == ["sweep"]


# -- every alert is tested, labelled and annotated ------------------------------------------------

def test_every_alert_has_a_firing_and_a_quiet_promtool_test():
    tests = yaml.safe_load(RULE_TESTS.read_text())
    assert tests["rule_files"] == ["alerts.yml"]
    firing, quiet = set(), set()
    for case in tests["tests"]:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {rule["alert"] for rule in alerts()}
    assert names - firing == set(), "alerts never tested firing"
    assert names - quiet == set(), "alerts never tested quiet"
    assert (firing | quiet) - names == set(), "tests of alerts that do not exist"


def test_every_firing_expectation_gives_labels_and_annotations():
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            for expected in check.get("exp_alerts") or []:
                assert expected.get("exp_labels", {}).get("severity") in SEVERITIES, (case["name"], expected)
                assert {"summary", "description", "runbook"} <= set(expected.get("exp_annotations", {})), case["name"]


def test_the_rule_group_is_stripe_ledger_and_alert_names_are_unique():
    groups = yaml.safe_load(RULES.read_text())["groups"]
    assert [group["name"] for group in groups] == ["stripe-ledger"]
    names = [rule["alert"] for rule in alerts()]
    assert len(names) == len(set(names)), names


def _slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading."""
    text = heading.replace("`", "").replace("*", "")  # the heading's text, without its inline markup
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # no headings in code blocks
    return {_slug(match) for match in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M)}


def _assert_doc_link_resolves(link: str, where: str):
    path, _, anchor = link.partition("#")
    page = ROOT / path
    assert page.is_file(), f"{where}: {link}: no such page"
    if anchor:
        assert anchor in _anchors(page), f"{where}: {link}: no such heading in {path}"


@pytest.mark.parametrize("rule", alerts(), ids=lambda rule: rule["alert"])
def test_every_alert_has_a_severity_summary_description_and_runbook(rule):
    assert rule["labels"]["severity"] in SEVERITIES
    annotations = rule["annotations"]
    assert annotations["summary"].strip() and annotations["description"].strip()
    runbook = annotations["runbook"]
    assert runbook.split("#")[0] == "docs/runbook.md", runbook
    _assert_doc_link_resolves(runbook, rule["alert"])
    for link in re.findall(r"\bdocs/[\w./-]+\.md(?:#[\w-]+)?", annotations["description"]):
        _assert_doc_link_resolves(link, rule["alert"])
    assert f"docs/monitoring.md#{rule['alert'].lower()}" in annotations["description"], \
        "the description names the alert's section of docs/monitoring.md"


def test_the_monitoring_page_has_a_section_per_alert():
    assert {rule["alert"].lower() for rule in alerts()} <= _anchors(DOCS / "monitoring.md")


# -- every queried metric is exported -------------------------------------------------------------

@pytest.mark.parametrize("expr, expected", [
    ('sum by (outcome) (rate(worker_attempts_total{outcome="failed_permanent", type=~"inv.*"}[5m]))',
     {"worker_attempts_total"}),
    ("histogram_quantile(0.99, sum by (le) (rate(ingest_request_seconds_bucket[$__rate_interval])))",
     {"ingest_request_seconds_bucket"}),
    ("time() - max(reconcile_last_run_timestamp_seconds) > 8 * 86400 and max(reconcile_last_run_timestamp_seconds) > 0",
     {"reconcile_last_run_timestamp_seconds"}),
    ("max(a_gauge) - max(a_gauge offset 15m) > 1e3 or sum(b_total unless b_total offset 1h)",
     {"a_gauge", "b_total"}),
    ("sum(rate(x_total[5m])) by (type) / on (type) group_left (name) max(y_info) > bool 0.5",
     {"x_total", "y_info"}),
    ("absent(up{job='sweep'})", {"up"}),
    ('label_replace(max by (type) (drift), "t", "$1", "type", "(.*)")', {"drift"}),
])
def test_metric_names_reads_the_selectors_of_a_promql_expression(expr, expected):
    assert metric_names(expr) == expected


def test_the_exported_names_are_read_from_the_code():
    names = exported_names()
    # A Counter declared as "x_total" is exposed as x_total (prometheus_client keeps "x" as its name).
    assert {"worker_attempts_total", "sweep_redrives_total", "ingest_requests_total",
            "stripe_health_alerts_total"} <= names
    assert {"worker_attempt_seconds_bucket", "ingest_request_seconds_bucket", "ingest_request_seconds_count"} <= names
    assert {"ledger_events", "ledger_oldest_unprocessed_age_seconds", "outbox_failed_permanent"} <= names
    assert "worker_attempts_total_total" not in names and "worker_attempts" not in names
    assert "worker_attempt_seconds" not in names  # a histogram has no sample of its bare name


@pytest.mark.parametrize("where, expr", queried_expressions(), ids=lambda value: value[:60])
def test_every_queried_metric_is_exported(where, expr):
    queried = metric_names(expr)
    assert queried, f"{where}: no metric found in {expr!r}"
    unknown = sorted(queried - exported_names())
    assert not unknown, (f"{where} queries {unknown}, which neither workers/metrics.py nor ingest/metrics.py "
                         f"exports (misspelled, renamed, or not added yet)")


# -- the dashboard --------------------------------------------------------------------------------

def test_the_dashboard_loads_with_unique_panel_ids():
    dashboard = load_dashboard()
    assert dashboard["uid"] and dashboard["title"]
    assert 36 <= dashboard["schemaVersion"] <= 41
    ids = [panel["id"] for panel in dashboard_panels()]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    titles = {panel["title"] for panel in dashboard_panels()}
    for expected in ("Events by status", "Oldest unprocessed age", "Attempts per minute by outcome",
                     "Attempt latency", "Ingest requests per minute by outcome", "Ingest latency",
                     "Sweep re-drives", "Lease rescues", "Outbox depth", "Catch-up: missed events",
                     "Health alerts", "Reconcile drift"):
        assert expected in titles


def test_every_dashboard_query_goes_to_the_provisioned_datasource():
    targets = dashboard_targets()
    assert targets
    for title, target in targets:
        assert target.get("datasource", {}).get("uid") == DATASOURCE_UID, title
        assert target.get("expr"), title
    for panel in dashboard_panels():
        if panel["type"] != "row":
            assert panel.get("datasource", {}).get("uid") == DATASOURCE_UID, panel["title"]
    assert "${DS" not in DASHBOARD.read_text()


def test_grafana_provisioning_names_the_datasource_uid_and_the_dashboard_folder():
    datasource, = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert datasource["uid"] == DATASOURCE_UID and datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"
    provider, = yaml.safe_load(DASHBOARD_PROVIDERS.read_text())["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]
