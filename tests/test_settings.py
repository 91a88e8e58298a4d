"""Settings objects: checked when built (errors name the option), one click option per field,
former spellings as hidden aliases, and the settings serve hands its children."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import orjson
import pytest
from click.testing import CliRunner

from sluice.bench.settings import BenchSettings
from sluice.cli import main
from sluice.options import Settings, SettingsError
from sluice.options_cli import settings_command
from sluice.settings import (
    WORKER_SETTINGS_ENV,
    GatewaySettings,
    JobsWorkerSettings,
    ServeSettings,
    WorkerSettings,
)

REPO = Path("/models")
URL = "redis://127.0.0.1:6379/0"
OLD_SPELLINGS = {
    "--request-timeout": ("request_timeout_s", "7.5", 7.5),
    "--job-ttl": ("job_ttl_s", "60", 60),
    "--redis-outage-grace": ("redis_outage_grace_s", "2", 2.0),
    "--drain-timeout": ("drain_timeout_s", "4", 4.0),
}


def _worker(**changes: Any) -> WorkerSettings:
    return WorkerSettings(model_repository=REPO, redis_url=URL, **changes)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: GatewaySettings(redis_url=URL, http_port=70000), "--http-port 70000: "),
        (lambda: GatewaySettings(redis_url=URL, metrics_port=0), "--metrics-port 0: "),
        (lambda: GatewaySettings(redis_url=URL, request_timeout_s=0), "--request-timeout-s 0: "),
        (lambda: GatewaySettings(redis_url=URL, job_ttl_s=0), "--job-ttl-s 0: "),
        (lambda: GatewaySettings(redis_url=URL, max_body_bytes=0), "--max-body-bytes 0: "),
        (
            lambda: GatewaySettings(redis_url=URL, redis_outage_grace_s=-1),
            "--redis-outage-grace-s -1: ",
        ),
        (lambda: GatewaySettings(redis_url=URL, drain_timeout_s=-1), "--drain-timeout-s -1: "),
        (lambda: GatewaySettings(redis_url=URL, log_level="loud"), "--log-level loud: "),
        (
            lambda: GatewaySettings(redis_url="http://u:secret@h:1"),
            "--redis-url http://u:***@h:1: unknown scheme 'http'",
        ),
        (lambda: GatewaySettings(redis_url=None), "--redis-url: required"),
        (lambda: _worker(claim_idle_ms=99), "--claim-idle-ms 99: must be at least 100"),
        (lambda: _worker(max_deliveries=0), "--max-deliveries 0: "),
        (lambda: _worker(batch_delay="soon"), "--batch-delay soon: must be one of fixed, adaptive"),
        (lambda: _worker(idle_poll_us=-1), "--idle-poll-us -1: "),
        (lambda: _worker(metrics_interval_ms=10), "--metrics-interval-ms 10: "),
        (lambda: _worker(health_port=0), "--health-port 0: "),
        (lambda: ServeSettings(model_repository=REPO, workers=0), "--workers 0: "),
        (lambda: ServeSettings(model_repository=REPO, bulk_workers=-1), "--bulk-workers -1: "),
        (lambda: JobsWorkerSettings(redis_url="tcp://h:1"), "--redis-url tcp://h:1: unknown"),
        (lambda: BenchSettings(model="m", url="https://h:1"), "--url https://h:1: https is not"),
        (lambda: BenchSettings(model="m", window_ms=0), "--window-ms 0: "),
        (lambda: BenchSettings(model="m", concurrency=(0,)), "--concurrency (0,): "),
        (
            lambda: BenchSettings(model="m", concurrency=(1,), request_rate=(2.0,)),
            "--request-rate: give it or --concurrency, not both",
        ),
    ],
)
def test_a_bad_value_names_its_option(build: Any, message: str) -> None:
    with pytest.raises(SettingsError) as error:
        build()
    assert str(error.value).startswith(message)
    assert str(error.value).startswith(error.value.option)


def test_settings_take_keywords_only_and_stay_as_built() -> None:
    with pytest.raises(TypeError):
        GatewaySettings(URL)  # type: ignore[misc]  # positional on purpose: refused
    settings = GatewaySettings(redis_url=URL)
    with pytest.raises(AttributeError):
        settings.http_port = 1  # type: ignore[misc]  # frozen on purpose: refused


def test_the_gateway_config_is_built_from_the_settings() -> None:
    settings = GatewaySettings(
        redis_url=URL,
        request_timeout_s=9.0,
        job_ttl_s=120,
        auth_token="t",
        redis_outage_grace_s=3.0,
        max_held_bytes=10,
        drain_timeout_s=5.0,
        idle_poll_us=0,
    )
    config = settings.config()
    assert (config.redis_url, config.drain_timeout_s, config.idle_poll_us) == (URL, 5.0, 0)
    limits = config.limits
    assert (limits.request_timeout_s, limits.job_ttl_s, limits.auth_token) == (9.0, 120, "t")
    assert (config.outage.grace_s, config.outage.max_held_bytes) == (3.0, 10)


def test_serve_gives_its_workers_its_batching_options_and_the_redis_it_runs() -> None:
    shared: dict[str, Any] = {
        "batch_delay": "adaptive",
        "idle_poll_us": 0,
        "claim_idle_ms": 5000,
        "max_deliveries": 7,
        "metrics_interval_ms": 500,
        "log_level": "warning",
        "drain_timeout_s": 3.0,
    }
    serve = ServeSettings(model_repository=REPO, http_port=9000, **shared)
    assert serve.worker_settings(URL) == _worker(**shared)
    assert serve.jobs_worker_settings(URL) == JobsWorkerSettings(
        redis_url=URL, log_level="warning", drain_timeout_s=3.0
    )


# ---------------------------------------------------------------- on the command line


def _collect(
    cls: type[Settings],
    args: list[str],
    env: dict[str, str] | None = None,
    handed_down: str | None = None,
) -> Any:
    """The settings a command of `cls` runs with, given `args` and `env`."""
    collected: list[Settings] = []
    command = click.command()(settings_command(cls, handed_down)(collected.append))
    result = CliRunner().invoke(command, args, env=env)
    if result.exit_code != 0:
        return result
    return collected[0]


def test_options_and_environment_make_the_settings() -> None:
    args = ["--redis-url", URL, "--http-port", "9000", "--auth-token", "t"]
    env = {"SLUICE_JOB_TTL_S": "61", "SLUICE_HTTP_PORT": "9999"}
    assert _collect(GatewaySettings, args, env) == GatewaySettings(
        redis_url=URL, http_port=9000, auth_token="t", job_ttl_s=61
    )
    assert _collect(
        WorkerSettings, ["--model-repository", "/m", "--models", "a, b"], {"SLUICE_REDIS_URL": URL}
    ) == WorkerSettings(model_repository=Path("/m"), redis_url=URL, models=("a", "b"))


@pytest.mark.parametrize("old", sorted(OLD_SPELLINGS))
def test_a_former_spelling_still_works_on_the_command_line_and_in_the_environment(
    old: str,
) -> None:
    name, text, value = OLD_SPELLINGS[old]
    assert getattr(_collect(GatewaySettings, ["--redis-url", URL, old, text]), name) == value
    env = {"SLUICE_" + old.lstrip("-").replace("-", "_").upper(): text}
    assert getattr(_collect(GatewaySettings, ["--redis-url", URL], env), name) == value
    # the current spelling wins over the former, each where it is written
    current = {"SLUICE_" + name.upper(): "1234", **env}
    assert getattr(_collect(GatewaySettings, ["--redis-url", URL], current), name) == 1234
    new_flag = "--" + name.replace("_", "-")
    both = ["--redis-url", URL, old, text, new_flag, "1234"]
    assert getattr(_collect(GatewaySettings, both), name) == 1234


@pytest.mark.parametrize("command", ["serve", "gateway", "worker", "jobs worker"])
def test_former_spellings_are_hidden_from_help(command: str) -> None:
    result = CliRunner().invoke(main, [*command.split(), "--help"])
    assert result.exit_code == 0, result.output
    flags = {word.rstrip(",") for word in result.output.split() if word.startswith("--")}
    assert not flags & set(OLD_SPELLINGS)
    assert "--drain-timeout-s" in flags
    if command in ("serve", "gateway"):
        assert {"--request-timeout-s", "--job-ttl-s", "--redis-outage-grace-s"} <= flags


def test_a_bad_value_on_the_command_line_is_one_line_exit_2() -> None:
    result = _collect(GatewaySettings, ["--redis-url", URL, "--job-ttl-s", "0"])
    assert (result.exit_code, result.output) == (2, "sluice: --job-ttl-s 0: must be at least 1\n")
    result = _collect(BenchSettings, ["--model", "m", "--concurrency", "1,x"])
    assert result.exit_code == 2
    assert result.output == "sluice: --concurrency 1,x: 'x' is not a number\n"
    missing = _collect(GatewaySettings, [], {"SLUICE_REDIS_URL": ""})
    assert missing.exit_code == 2 and "Missing option '--redis-url'" in missing.output


def test_handed_down_settings_come_before_the_environment_but_after_the_command_line() -> None:
    handed = ServeSettings(
        model_repository=REPO, batch_delay="adaptive", idle_poll_us=0, claim_idle_ms=5000
    ).worker_settings(URL)
    env = {
        WORKER_SETTINGS_ENV: orjson.dumps(handed.to_json_dict()).decode(),
        "SLUICE_CLAIM_IDLE_MS": "20000",  # what the parent's own environment says: not for it
        "SLUICE_HEALTH_PORT": "8003",
    }
    assert _collect(WorkerSettings, [], env, WORKER_SETTINGS_ENV) == handed
    given = _collect(WorkerSettings, ["--max-deliveries", "9"], env, WORKER_SETTINGS_ENV)
    assert given.max_deliveries == 9 and given.claim_idle_ms == 5000


def test_handed_down_settings_that_are_not_json_or_not_known_are_refused() -> None:
    for text, reason in (("{", "not JSON"), ('{"speed": 1}', "unknown settings speed")):
        result = _collect(WorkerSettings, [], {WORKER_SETTINGS_ENV: text}, WORKER_SETTINGS_ENV)
        assert result.exit_code == 2
        assert result.output.startswith(f"sluice: {WORKER_SETTINGS_ENV}: {reason}")


# ---------------------------------------------------------------- secrets out of argv


def test_the_auth_token_comes_from_a_file_without_its_line_end(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    args = ["--redis-url", URL, "--auth-token-file", str(token_file)]
    settings = _collect(GatewaySettings, args)
    assert (settings.auth_token, settings.auth_token_file) == ("s3cret", None)
    from_env = _collect(
        GatewaySettings, ["--redis-url", URL], {"SLUICE_AUTH_TOKEN_FILE": str(token_file)}
    )
    assert from_env.auth_token == "s3cret"


def test_the_auth_token_comes_from_the_environment_and_the_command_line_wins() -> None:
    env = {"SLUICE_AUTH_TOKEN": "from-env"}
    assert _collect(GatewaySettings, ["--redis-url", URL], env).auth_token == "from-env"
    args = ["--redis-url", URL, "--auth-token", "from-argv"]
    assert _collect(GatewaySettings, args, env).auth_token == "from-argv"


def test_a_token_given_both_directly_and_in_a_file_is_refused(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("one")
    args = ["--redis-url", URL, "--auth-token-file", str(token_file)]
    result = _collect(GatewaySettings, args, {"SLUICE_AUTH_TOKEN": "two"})
    assert result.exit_code == 2
    assert result.output == "sluice: --auth-token-file: give it or --auth-token, not both\n"


@pytest.mark.parametrize(
    ("content", "reason"),
    [(None, "cannot read it (No such file or directory)"), ("\n", "the file is empty")],
    ids=["missing", "empty"],
)
def test_a_secret_file_that_cannot_be_used_is_a_one_line_error(
    tmp_path: Path, content: str | None, reason: str
) -> None:
    path = tmp_path / "secret"
    if content is not None:
        path.write_text(content)
    for cls, flag, required in (
        (GatewaySettings, "--auth-token-file", ["--redis-url", URL]),
        (WorkerSettings, "--redis-password-file", ["--redis-url", URL, "--model-repository", "/m"]),
    ):
        result = _collect(cls, [*required, flag, str(path)])
        assert (result.exit_code, result.output) == (2, f"sluice: {flag} {path}: {reason}\n")


def test_a_secret_path_that_is_not_a_readable_file_names_its_option(tmp_path: Path) -> None:
    with pytest.raises(SettingsError) as error:
        GatewaySettings(redis_url=URL, auth_token_file=tmp_path)
    assert str(error.value) == f"--auth-token-file {tmp_path}: cannot read it (Is a directory)"


def test_the_redis_password_goes_into_the_url_that_serve_hands_its_children(
    tmp_path: Path,
) -> None:
    password_file = tmp_path / "password"
    password_file.write_text("p@ss:w/rd\n")
    args = ["--model-repository", "/m", "--redis-url", "redis://user@h:6379/0"]
    serve = _collect(ServeSettings, [*args, "--redis-password-file", str(password_file)])
    url = "redis://user:p%40ss%3Aw%2Frd@h:6379/0"
    assert (serve.redis_url, serve.redis_password, serve.redis_password_file) == (url, None, None)
    handed = serve.worker_settings(serve.redis_url).to_json_dict()
    assert handed["redis_url"] == url and handed["redis_password_file"] is None
    env = {"SLUICE_REDIS_PASSWORD": "p@ss:w/rd"}
    assert _collect(ServeSettings, args, env).redis_url == url
    sentinel = "redis+sentinel://h1:26379,h2:26379/main"
    assert (
        JobsWorkerSettings(redis_url=sentinel, redis_password="pw").redis_url
        == "redis+sentinel://:pw@h1:26379,h2:26379/main"
    )


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: GatewaySettings(redis_url="redis://:old@h:1", redis_password="new"),
            "--redis-password: --redis-url redis://:***@h:1 holds one already",
        ),
        (
            lambda: ServeSettings(model_repository=REPO, redis_password="pw"),
            "--redis-password: needs --redis-url (the embedded Redis takes none)",
        ),
        (
            lambda: WorkerSettings(
                model_repository=REPO,
                redis_url=URL,
                redis_password="a",
                redis_password_file=Path("/f"),
            ),
            "--redis-password-file: give it or --redis-password, not both",
        ),
    ],
    ids=["password twice", "embedded redis", "password and file"],
)
def test_a_redis_password_that_cannot_be_used_is_refused(build: Any, message: str) -> None:
    with pytest.raises(SettingsError) as error:
        build()
    assert str(error.value) == message


# ---------------------------------------------------------------- Triton's restricted APIs


def test_restricted_api_flags_repeat_and_reach_the_gateway_config() -> None:
    args = [
        "--redis-url",
        URL,
        "--http-restricted-api",
        "model-repository,model-config:admin-key=a=b",
        "--http-restricted-api",
        "inference:infer-key=i",
        "--grpc-restricted-protocol",
        "model-repository:admin-key=g",
        "--metrics-auth-token",
        "m",
    ]
    limits = _collect(GatewaySettings, args).config().limits
    assert {c: (r.header, r.value) for c, r in limits.http_restrictions.items()} == {
        "model-repository": ("admin-key", "a=b"),
        "model-config": ("admin-key", "a=b"),
        "inference": ("infer-key", "i"),
    }
    assert {c: (r.header, r.value) for c, r in limits.grpc_restrictions.items()} == {
        "model-repository": ("triton-grpc-protocol-admin-key", "g"),
    }
    assert limits.metrics_auth_token == "m"


@pytest.mark.parametrize(
    ("flag", "specs", "triton_says"),
    [
        ("--http-restricted-api", ["health,nap:k=v"], "unknown restricted api 'nap'"),
        ("--grpc-restricted-protocol", ["nap:k=v"], "unknown restricted protocol 'nap'"),
        (
            "--http-restricted-api",
            ["health:k=v", "metadata,health:j=w"],
            "restricted api 'health' can not be specified in multiple config groups",
        ),
        (
            "--grpc-restricted-protocol",
            ["inference:k"],
            "--grpc-restricted-protocol option format is '<config name>:<setting>=<value>'. "
            "Got inference:k",
        ),
        (
            "--http-restricted-api",
            ["inference:k="],
            "--http-restricted-api option format is '<config name>:<setting>=<value>'. "
            "Got inference:k=",
        ),
    ],
)
def test_a_bad_restricted_api_flag_is_refused_in_tritons_words(
    flag: str, specs: list[str], triton_says: str
) -> None:
    args = ["--redis-url", URL, *(word for spec in specs for word in (flag, spec))]
    result = _collect(GatewaySettings, args)
    assert result.exit_code == 2
    assert result.output == f"sluice: {flag} {' '.join(specs)}: {triton_says}\n"


@pytest.mark.parametrize("command", ["serve", "gateway"])
def test_serve_and_gateway_both_take_the_access_flags(command: str) -> None:
    result = CliRunner().invoke(main, [command, "--help"])
    flags = {word.rstrip(",") for word in result.output.split() if word.startswith("--")}
    assert {
        "--http-restricted-api",
        "--grpc-restricted-protocol",
        "--auth-token-file",
        "--metrics-auth-token",
        "--redis-password-file",
    } <= flags
