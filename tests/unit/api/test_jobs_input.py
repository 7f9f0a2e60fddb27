"""`raytrain submit` / `raytrain jobs`: bad input is refused before any cluster is contacted."""

from __future__ import annotations

import pytest

from raytrain_app import cli


@pytest.fixture
def no_cluster(monkeypatch, tmp_path):
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my.yaml").write_text("train: {epochs: 1}\n")
    return tmp_path


def one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["submit", "--", "train"], "pass --address http://HEAD:8265"),
        (["jobs", "list"], "pass --address http://HEAD:8265"),
        (["submit", "--address", "http://x:1", "--", "plan"], "submit runs one of train, tune"),
        (["submit", "--address", "http://x:1"], "got nothing"),
        (
            ["submit", "--address", "http://x:1", "--", "train", "--config", "nope.yaml"],
            "--config 'nope.yaml' does not exist",
        ),
        (
            ["submit", "--address", "http://x:1", "--working-dir", "missing", "--", "train"],
            "--working-dir 'missing' is not a directory",
        ),
    ],
)
def test_bad_submissions_exit_2_with_one_line(no_cluster, capsys, argv, message):
    assert cli.main(argv) == 2
    assert message in one_error_line(capsys)


def test_a_config_outside_the_working_dir_is_refused(no_cluster, capsys, tmp_path_factory):
    outside = tmp_path_factory.mktemp("elsewhere") / "other.yaml"
    outside.write_text("train: {epochs: 1}\n")
    argv = ["submit", "--address", "http://x:1", "--", "train", "--config", str(outside)]
    assert cli.main(argv) == 2
    assert "outside the working directory" in one_error_line(capsys)


def test_unreachable_job_server_names_the_address(no_cluster, capsys):
    assert cli.main(["jobs", "--address", "http://127.0.0.1:1", "list"]) == 2
    line = one_error_line(capsys)
    assert "--address http://127.0.0.1:1: nothing is listening on 127.0.0.1:1" in line
