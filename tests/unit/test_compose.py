"""docker-compose.yml, Dockerfile and .env.example agree with the code they run.

No Docker engine is needed: the compose file is parsed with PyYAML and each
service's command is resolved against pyproject.toml and the installed project
(console scripts, the ledgerctl subcommands, the gunicorn app target, the Celery
app behind ``celery -A workers``). When the ``docker compose`` client is
installed, ``docker compose config -q`` (which needs no engine) validates the
file against the Compose specification as well.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
DOCKERFILE = ROOT / "Dockerfile"
PYPROJECT = ROOT / "pyproject.toml"

APP_SERVICES = ("migrate", "receiver", "worker", "sweep", "flower")
SERVICES = ("postgres", "redis") + APP_SERVICES
VALID_CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}

# The variables ledger/config.py and the process commands read; .env.example documents each.
DOCUMENTED_VARIABLES = (
    "DATABASE_URL", "CELERY_BROKER_URL", "STRIPE_WEBHOOK_SECRET", "STRIPE_THIN_WEBHOOK_SECRET", "STRIPE_API_KEY",
    "STRIPE_API_BASE", "STRIPE_FETCH_TIMEOUT_S", "STRIPE_FETCH_CONCURRENCY", "STRIPE_SIGNATURE_TOLERANCE_S", "INGEST_MAX_BODY_BYTES", "LEDGER_LEASE_S", "LEDGER_DEAD_PEER_S",
    "LEDGER_RESCUE_INTERVAL_S", "LEDGER_MAX_ATTEMPTS",
    "LEDGER_RETRY_BASE_S", "LEDGER_RETRY_CAP_S", "LEDGER_SWEEP_OVERDUE_S", "LEDGER_SWEEP_BATCH",
    "LEDGER_SWEEP_INTERVAL_S", "LEDGER_HANDLER_MODULES", "LEDGER_ENTITLEMENTS_MAP", "LOG_LEVEL",
    "PROMETHEUS_MULTIPROC_DIR", "GUNICORN_WORKERS", "GUNICORN_THREADS", "WORKER_CONCURRENCY", "FLOWER_BASIC_AUTH",
)


# -- helpers ----------------------------------------------------------------------------

def load_compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def load_pyproject() -> dict:
    return tomllib.loads(PYPROJECT.read_text())


def services() -> dict:
    return load_compose()["services"]


def command_of(service: str) -> list[str]:
    command = services()[service].get("command")
    assert command, f"service {service} has no command"
    return shlex.split(command) if isinstance(command, str) else [str(part) for part in command]


def env_example() -> dict[str, str]:
    """KEY=value lines of .env.example (comments and blank lines ignored)."""
    values = {}
    for number, line in enumerate(ENV_EXAMPLE.read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key), f".env.example:{number}: not KEY=value: {line!r}"
        values[key] = value
    return values


def declared_distributions() -> set[str]:
    project = load_pyproject()["project"]
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements.extend(extra)
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def depends_on(service: str) -> dict[str, dict]:
    """depends_on in its long form: {service: {condition: ...}} (the short list form means service_started)."""
    raw = services()[service].get("depends_on") or {}
    if isinstance(raw, list):
        return {name: {"condition": "service_started"} for name in raw}
    return {name: (spec or {"condition": "service_started"}) for name, spec in raw.items()}


def ledgerctl_subcommand(service: str) -> list[str]:
    argv = command_of(service)
    assert argv[0] == "ledgerctl"
    return argv[1:]


# -- the services ---------------------------------------------------------------------------

def test_every_service_exists():
    missing = set(SERVICES) - set(services())
    assert not missing, f"docker-compose.yml lacks services: {sorted(missing)}"


def test_worker_is_scalable():
    worker = services()["worker"]
    assert "container_name" not in worker, "a fixed container_name breaks `--scale worker=N`"
    assert not worker.get("ports"), "a host port mapping breaks `--scale worker=N`"


def test_app_services_take_their_config_from_dotenv():
    for name in APP_SERVICES:
        env_file = services()[name].get("env_file")
        files = [env_file] if isinstance(env_file, (str, dict)) else list(env_file or [])
        paths = [f["path"] if isinstance(f, dict) else f for f in files]
        assert ".env" in paths, f"service {name} does not read .env (env_file)"


def test_redis_appends_only():
    argv = command_of("redis")
    assert "--appendonly" in argv and argv[argv.index("--appendonly") + 1] == "yes", argv
    assert services()["redis"].get("volumes"), "redis keeps its AOF on a volume"


def test_postgres_keeps_its_data_on_a_named_volume():
    compose = load_compose()
    volumes = compose["services"]["postgres"].get("volumes") or []
    targets = {}
    for volume in volumes:
        if isinstance(volume, str):
            source, _, rest = volume.partition(":")
            targets[rest.split(":")[0]] = source
        else:
            targets[volume["target"]] = volume.get("source")
    assert "/var/lib/postgresql/data" in targets, f"postgres has no data volume: {volumes}"
    assert targets["/var/lib/postgresql/data"] in (compose.get("volumes") or {}), "the data volume is not a named volume"


def test_receiver_publishes_8000_and_is_health_checked_on_healthz():
    receiver = services()["receiver"]
    assert any(str(p).split("/")[0].endswith("8000:8000") for p in receiver.get("ports", [])), receiver.get("ports")
    test = receiver["healthcheck"]["test"]
    assert "/healthz" in (test if isinstance(test, str) else " ".join(test))


def test_flower_listens_on_5555_with_basic_auth_from_the_environment():
    flower = services()["flower"]
    argv = command_of("flower")
    assert "flower" in argv and "--port=5555" in argv, argv
    assert any(str(p).split("/")[0].endswith("5555:5555") for p in flower.get("ports", [])), flower.get("ports")
    user, sep, password = env_example().get("FLOWER_BASIC_AUTH", "").partition(":")
    assert user and sep and password, ".env.example must give FLOWER_BASIC_AUTH as user:password"


# -- depends_on -------------------------------------------------------------------------------

def test_depends_on_conditions_are_valid_and_name_existing_services():
    all_services = services()
    for name in all_services:
        for target, spec in depends_on(name).items():
            assert target in all_services, f"{name} depends on unknown service {target}"
            condition = spec.get("condition", "service_started")
            assert condition in VALID_CONDITIONS, f"{name} -> {target}: invalid condition {condition!r}"
            if condition == "service_healthy":
                assert all_services[target].get("healthcheck"), f"{name} waits for {target} to be healthy, but it has no healthcheck"


@pytest.mark.parametrize("service, target, condition", [
    ("migrate", "postgres", "service_healthy"),
    ("receiver", "migrate", "service_completed_successfully"),
    ("receiver", "redis", "service_healthy"),
    ("worker", "migrate", "service_completed_successfully"),
    ("sweep", "migrate", "service_completed_successfully"),
])
def test_start_order(service, target, condition):
    assert depends_on(service).get(target, {}).get("condition") == condition


def test_migrate_is_one_shot():
    assert str(services()["migrate"].get("restart", "no")) == "no"


# -- commands resolve to what the project installs -------------------------------------------

@pytest.mark.parametrize("service", APP_SERVICES)
def test_command_executable_is_declared_in_pyproject(service):
    executable = command_of(service)[0]
    scripts = load_pyproject()["project"].get("scripts", {})
    if executable in scripts:
        return
    distribution = canonicalize_name(executable)
    assert distribution in declared_distributions(), (
        f"{service}: {executable!r} is neither a [project.scripts] entry nor a declared dependency")
    installed = {ep.name for ep in importlib.metadata.distribution(distribution).entry_points
                 if ep.group == "console_scripts"}
    assert executable in installed, f"{distribution} installs no console script {executable!r}"


def test_ledgerctl_script_points_at_the_cli():
    assert load_pyproject()["project"]["scripts"]["ledgerctl"] == "ops.cli:main"


def test_flower_is_declared():
    # `celery flower` is a plugin subcommand: the flower distribution must be installable with the project.
    assert "flower" in declared_distributions()


@pytest.mark.parametrize("service", ["migrate", "sweep"])
def test_ledgerctl_subcommand_exists(service):
    from ops.cli import cli

    argv = ledgerctl_subcommand(service)
    subcommand, options = argv[0], [a for a in argv[1:] if a.startswith("--")]
    result = CliRunner().invoke(cli, [subcommand, "--help"])
    assert result.exit_code == 0, f"`ledgerctl {subcommand} --help` exited {result.exit_code}:\n{result.output}"
    for option in options:
        assert option.split("=")[0] in result.output, f"`ledgerctl {subcommand}` has no option {option}"


def test_gunicorn_app_target_is_importable():
    argv = command_of("receiver")
    target = argv[-1]  # gunicorn's APP_MODULE is its last, positional, argument
    assert target == "ingest.app:create_app()", argv
    module_name, _, attribute = target.partition(":")
    module = importlib.import_module(module_name)
    assert callable(getattr(module, attribute.removesuffix("()")))


@pytest.mark.parametrize("service", ["worker", "flower"])
def test_celery_app_option_resolves_to_a_celery_instance(service):
    argv = command_of(service)
    assert argv[:3] == ["celery", "-A", "workers"], argv
    # A process of its own, as `celery -A workers` would be (workers.celery configures logging on import).
    script = (
        "import importlib, celery\n"
        "from celery.app.utils import find_app\n"
        "module = importlib.import_module('workers.celery')\n"
        "assert isinstance(getattr(module, 'app', None), celery.Celery), 'workers.celery.app is not a Celery instance'\n"
        "assert find_app('workers') is module.app, 'celery -A workers does not resolve to workers.celery.app'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# -- .env.example ------------------------------------------------------------------------------

def test_env_example_documents_every_variable():
    missing = [name for name in DOCUMENTED_VARIABLES if name not in env_example()]
    assert not missing, f".env.example lacks {missing}"


def test_every_interpolated_variable_is_in_env_example():
    def strings(node):
        if isinstance(node, dict):
            for key, value in node.items():
                yield str(key)
                yield from strings(value)
        elif isinstance(node, list):
            for item in node:
                yield from strings(item)
        elif node is not None:
            yield str(node)

    # Every value (comments are not interpolated): ${VAR}, ${VAR:-default}, ${VAR:?error} and $VAR;
    # $$ is a literal dollar for the container's shell.
    text = "\n".join(strings(load_compose())).replace("$$", "")
    referenced = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", text)) | set(re.findall(r"\$([A-Za-z_][A-Za-z0-9_]*)", text))
    missing = sorted(referenced - set(env_example()))
    assert not missing, f"docker-compose.yml uses variables missing from .env.example: {missing}"


def test_env_example_is_a_valid_configuration():
    from ledger.config import Settings

    values = env_example()
    settings = Settings.from_env(values)
    assert settings.require_webhook_secrets()
    assert values["STRIPE_WEBHOOK_SECRET"].startswith("whsec_")
    assert "placeholder" in values["STRIPE_WEBHOOK_SECRET"].lower(), "the example secret must say it is a placeholder"


def test_database_url_matches_the_postgres_container():
    values = env_example()
    expected = f"postgresql://{values['POSTGRES_USER']}:{values['POSTGRES_PASSWORD']}@postgres:5432/{values['POSTGRES_DB']}"
    assert values["DATABASE_URL"] == expected


# -- Dockerfile --------------------------------------------------------------------------------

def test_dockerfile_installs_the_project_as_a_non_root_user():
    lines = [line.strip() for line in DOCKERFILE.read_text().splitlines()]
    assert "FROM python:3.11-slim" in lines
    assert any(line.startswith("RUN pip install") and '".[ops]"' in line for line in lines)
    users = [line.split(None, 1)[1] for line in lines if line.startswith("USER ")]
    assert users, "the image runs as root"
    assert users[-1].split(":")[0] not in {"root", "0"}


# -- docker compose config (the Compose specification itself) ------------------------------

def _docker_compose_client() -> list[str] | None:
    docker = shutil.which("docker")
    if docker is None:
        return None
    probe = subprocess.run([docker, "compose", "version"], capture_output=True, text=True, timeout=60)
    return [docker, "compose"] if probe.returncode == 0 else None


def test_docker_compose_config_accepts_the_file(tmp_path):
    if shutil.which("docker") is None:
        pytest.skip("docker client not installed")
    client = _docker_compose_client()
    if client is None:
        pytest.skip("docker client installed without the compose plugin (`docker compose version` fails)")
    # A copy, so the .env made from .env.example never lands next to a developer's real one.
    shutil.copy(COMPOSE_FILE, tmp_path / "docker-compose.yml")
    shutil.copy(DOCKERFILE, tmp_path / "Dockerfile")
    shutil.copy(ENV_EXAMPLE, tmp_path / ".env")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    result = subprocess.run(client + ["-f", "docker-compose.yml", "config", "-q"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
