from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from loadgen.cli import build_parser, main
from table_builder.records import read_records
from tests.support.fake_openai import FakeWorker


@pytest.mark.integration
async def test_ppd_bench_run_writes_records_and_prints_the_summary(tmp_path: Path) -> None:
    fake = await FakeWorker("fake", "replica").start()
    url = fake.url
    try:
        out = tmp_path / "deep" / "run.jsonl"
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "loadgen.cli",
            "run",
            "--url",
            url,
            "--workload",
            "sharegpt",
            "--qps",
            "8",
            "--duration",
            "0.5",
            "--out",
            str(out),
            "--seed",
            "3",
            "--turns",
            "3",
            "--mode",
            "local",
            "--no-progress",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await proc.communicate()
    finally:
        await fake.close()
    assert proc.returncode == 0, stderr.decode()
    text = stdout.decode()
    assert "TTFT Turn 2+" in text
    assert "success:" in text
    records = read_records([out])
    assert records
    assert {r.workload for r in records} == {"sharegpt"}
    assert {r.run_id for r in records} == {"sharegpt-local-q8-s3"}
    assert max(r.turn for r in records) <= 3
    assert all(r.path == "local" for r in records if r.turn > 1)


def test_every_command_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["run", "--help"], ["report", "--help"]):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(argv)
        assert exc.value.code == 0
    assert "--workload" in capsys.readouterr().out


def test_bad_arguments_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["run", "--url", "u", "--workload", "w", "--qps", "0", "--duration", "1", "--out", "x"],
        [
            "run",
            "--url",
            "u",
            "--workload",
            "w",
            "--qps",
            "1",
            "--duration",
            "1",
            "--out",
            "x",
            "--mode",
            "fast",
        ],
    ):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(argv)
        assert exc.value.code == 2
    capsys.readouterr()


def test_an_unknown_workload_or_dead_url_exits_1(tmp_path: Path) -> None:
    base = ["run", "--qps", "1", "--duration", "1", "--out", str(tmp_path / "r.jsonl"), "--no-progress"]
    assert main([*base, "--url", "http://127.0.0.1:1", "--workload", "medium_tiny"]) == 1
    assert main([*base, "--url", "http://127.0.0.1:1", "--workload", "small_tiny", "--timeout", "2"]) == 1


@pytest.mark.integration
async def test_ppd_bench_run_takes_a_shared_prefix_workload(tmp_path: Path) -> None:
    fake = await FakeWorker("fake", "replica").start()
    try:
        out = tmp_path / "run.jsonl"
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "loadgen.cli",
            "run",
            "--url",
            fake.url,
            "--workload",
            "shared1024_2x3_small_tiny",
            "--qps",
            "20",
            "--duration",
            "0.3",
            "--out",
            str(out),
            "--no-progress",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        _, stderr = await proc.communicate()
        systems = {s.body["messages"][0]["content"] for s in fake.completions()}
    finally:
        await fake.close()
    assert proc.returncode == 0, stderr.decode()
    records = read_records([out])
    assert {r.workload for r in records} == {"shared1024_2x3_small_tiny"}
    assert {(r.n_in, r.n_out) for r in records if r.turn == 1} == {(1024 + 128, 128)}
    assert {(r.n_in, r.n_out) for r in records if r.turn == 2} == {(16, 32)}
    assert len({r.conversation_id for r in records}) > 2
    assert len(systems) == 2  # two groups, one system prompt each


@pytest.mark.parametrize(
    ("workload", "fragment"),
    [
        ("shared8_2x2_small_tiny", "it must be 16..8192"),
        ("shared1024_0x2_small_tiny", "groups must be 1..10000"),
        ("shared1024_2x2_medium_tiny", "unknown synthetic workload 'medium_tiny'"),
        ("shared_prefix", "expected shared<L>_<G>x<C>_<turn1>_<class>"),
    ],
)
def test_a_bad_shared_prefix_workload_exits_1_saying_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, workload: str, fragment: str
) -> None:
    argv = ["run", "--url", "http://127.0.0.1:1", "--qps", "1", "--duration", "1", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "r.jsonl"), "--workload", workload]) == 1
    assert fragment in caplog.text
