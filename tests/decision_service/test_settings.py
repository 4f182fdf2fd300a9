"""Settings: read once, validated, from the environment or the command line."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from decision_service.settings import Settings, SettingsError
from decision_service.workers import worker_command


def test_defaults_are_loopback_and_free_ports() -> None:
    settings = Settings()
    assert (settings.host, settings.port, settings.metrics_port) == ("127.0.0.1", 0, 0)


def test_from_env_reads_only_the_prefixed_variables() -> None:
    settings = Settings.from_env(
        {
            "PPD_DECISION_TABLES": "/srv/tables",
            "PPD_DECISION_PORT": "50051",
            "PPD_DECISION_DEFAULT_KEY": "2P2D/m",
            "PPD_DECISION_RELOAD_INTERVAL": "0.5",
            "PPD_DECISION_WORKERS": "3",
            "PORT": "1",
        }
    )
    assert settings.tables_dir == Path("/srv/tables")
    assert settings.port == 50051
    assert settings.default_key == "2P2D/m"
    assert settings.reload_interval_s == 0.5
    assert settings.workers == 3


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"PPD_DECISION_PORT": "http"}, "PPD_DECISION_PORT='http'"),
        ({"PPD_DECISION_PORT": "70000"}, "port must be in 0..65535"),
        ({"PPD_DECISION_RELOAD_INTERVAL": "0"}, "reload_interval_s must be a positive"),
        ({"PPD_DECISION_GRACE": "nan"}, "grace_s must be a positive"),
        ({"PPD_DECISION_WORKERS": "0"}, "workers must be at least 1"),
        ({"PPD_DECISION_DEFAULT_KEY": ""}, "default_key must not be empty"),
        ({"PPD_DECISION_MAX_BATCH_ITEMS": "0"}, "max_batch_items must be at least 1"),
        ({"PPD_DECISION_MAX_MESSAGE_BYTES": "100"}, "max_message_bytes must be at least 1024"),
        (
            {"PPD_DECISION_KEEPALIVE_MIN_PING_INTERVAL": "-1"},
            "keepalive_min_ping_interval_s must be a positive",
        ),
        ({"PPD_DECISION_TRACING": "maybe"}, "PPD_DECISION_TRACING='maybe'"),
        ({"PPD_DECISION_TRACING_SAMPLING_RATIO": "1.5"}, "tracing_sampling_ratio must be between 0 and 1"),
        ({"PPD_DECISION_TRACING_PROTOCOL": "http/protobuf"}, "tracing_protocol must be 'grpc'"),
        ({"PPD_DECISION_TRACING_TIMEOUT": "0"}, "tracing_timeout_s must be a positive"),
        ({"PPD_DECISION_TRACING_HEADERS": "api-key"}, "OTLP header 'api-key' is not key=value"),
        (
            {"PPD_DECISION_TRACING": "true", "PPD_DECISION_TRACING_ENDPOINT": "collector:4317"},
            "tracing_endpoint must be http://host:port or https://host:port",
        ),
    ],
)
def test_bad_values_name_the_setting(environ: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message.replace("(", r"\(").replace(".", r"\.")):
        Settings.from_env(environ)


def test_with_changes_validates_again() -> None:
    with pytest.raises(SettingsError):
        Settings().with_changes(metrics_port=-1)


def test_limits_and_keepalive_come_from_the_environment() -> None:
    settings = Settings.from_env(
        {
            "PPD_DECISION_MAX_BATCH_ITEMS": "100",
            "PPD_DECISION_MAX_MESSAGE_BYTES": "65536",
            "PPD_DECISION_KEEPALIVE_MIN_PING_INTERVAL": "2.5",
        }
    )
    assert (settings.max_batch_items, settings.max_message_bytes) == (100, 65536)
    assert settings.keepalive_min_ping_interval_s == 2.5


def test_workers_get_every_limit() -> None:
    settings = Settings(max_batch_items=7, max_message_bytes=4096, keepalive_min_ping_interval_s=1.5)
    command = worker_command(settings, port=1, metrics_port=2)
    pairs = dict(itertools.pairwise(command))
    assert pairs["--max-batch-items"] == "7"
    assert pairs["--max-message-bytes"] == "4096"
    assert float(pairs["--keepalive-min-ping-interval"]) == 1.5


def test_tracing_comes_from_the_environment_and_hides_header_values() -> None:
    settings = Settings.from_env(
        {
            "PPD_DECISION_TRACING": "on",
            "PPD_DECISION_TRACING_SAMPLING_RATIO": "0.25",
            "PPD_DECISION_TRACING_ENDPOINT": "https://tempo:4317",
            "PPD_DECISION_TRACING_HEADERS": "X-Api-Key=s3cret, tenant=a",
        }
    )
    tracing = settings.tracing
    assert (tracing.enabled, tracing.sampling_ratio, tracing.endpoint) == (True, 0.25, "https://tempo:4317")
    assert dict(tracing.headers) == {"x-api-key": "s3cret", "tenant": "a"}
    assert "s3cret" not in repr(tracing)
    assert "s3cret" not in repr(settings)
    assert not Settings().tracing.enabled
