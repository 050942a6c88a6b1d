"""A role's flags from SPLITEDGE_* variables and a TOML run config (splitedge/cli_defaults.py):
the command line wins, then the variable, then the file; a bad file or value is one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitedge.cli import build_parser, main

CONFIG = """
[common]
broker = "mqtt://site:1883"
run = "r7"

[edge]
id = "e3"
threads = 2
takeover = true

[device]
id = "d9"
edge = "e3"
"""


def _parse(role: str, argv: list[str], monkeypatch, env: dict[str, str] | None = None):
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    full = [role, *argv]
    return build_parser(role, full).parse_args(full)


def test_a_config_file_gives_each_role_its_section_and_the_common_one(tmp_path: Path, monkeypatch) -> None:
    # Prepare
    path = tmp_path / "run.toml"
    path.write_text(CONFIG)
    # Execute
    edge = _parse("edge", ["--config", str(path)], monkeypatch)
    device = _parse("device", [f"--config={path}", "--data", "x.npz"], monkeypatch)
    # Assert: typed as the flags would have parsed them; no required flag was missing
    assert (edge.broker, edge.run, edge.id, edge.threads, edge.takeover) == ("mqtt://site:1883", "r7", "e3", 2, True)
    assert (device.id, device.edge, device.run) == ("d9", "e3", "r7")


def test_the_command_line_wins_then_the_variable_then_the_file(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "run.toml"
    path.write_text(CONFIG)
    args = _parse("edge", ["--config", str(path), "--id", "e0"], monkeypatch,
                  env={"SPLITEDGE_ID": "e1", "SPLITEDGE_RUN": "from-env"})
    assert (args.id, args.run, args.broker) == ("e0", "from-env", "mqtt://site:1883")


def test_a_relative_path_in_a_config_file_is_from_the_file_s_folder(tmp_path: Path, monkeypatch) -> None:
    """So a bundle of `splitedge provision` works wherever it is copied; a variable's or a flag's
    relative path stays the working directory's, as a shell user expects."""
    (tmp_path / "node").mkdir()
    path = tmp_path / "node" / "run.toml"
    path.write_text(CONFIG + 'data = "shard.npz"\npassword-file = "../secret"\nsign-key = "/abs/node.key"\n')
    monkeypatch.chdir(tmp_path)
    device = _parse("device", ["--config", str(path)], monkeypatch)
    assert device.data == tmp_path / "node" / "shard.npz" and device.password_file == tmp_path / "node" / ".." / "secret"
    assert device.sign_key == Path("/abs/node.key") and device.broker == "mqtt://site:1883"  # not a path: as given
    by_hand = _parse("device", ["--config", str(path), "--data", "mine.npz"], monkeypatch,
                     env={"SPLITEDGE_PASSWORD_FILE": "pw"})
    assert by_hand.data == Path("mine.npz") and by_hand.password_file == Path("pw")


def test_the_units_variables_start_a_role_without_flags(monkeypatch) -> None:
    """What deploy/env/device.env sets is what `splitedge device` needs."""
    env = {"SPLITEDGE_BROKER": "mqtt://edge-site.local:1883", "SPLITEDGE_ID": "d0", "SPLITEDGE_EDGE": "e0",
           "SPLITEDGE_DATA": "/var/lib/splitedge/shard.npz", "SPLITEDGE_BACKEND": "onnx", "SPLITEDGE_RUN": "default",
           "SPLITEDGE_CA_FILE": ""}  # an empty placeholder gives nothing
    args = _parse("device", [], monkeypatch, env=env)
    assert (args.broker, args.id, args.edge, str(args.data), args.backend) == (
        "mqtt://edge-site.local:1883", "d0", "e0", "/var/lib/splitedge/shard.npz", "onnx")
    assert args.ca_file is None


@pytest.mark.parametrize("text, env, says", [
    ("[edge]\nrounds = 3\n", {}, "splitedge edge has no setting 'rounds'"),
    ("[edges]\nid = 'e0'\n", {}, "unknown section [edges]"),
    ("[edge\n", {}, "not TOML"),
    ("[edge]\nthreads = 'many'\n", {}, "--threads 'many'"),
    ("[edge]\ntakeover = 'perhaps'\n", {}, "--takeover is on or off"),
    ("", {"SPLITEDGE_THREADS": "x"}, "SPLITEDGE_THREADS: --threads 'x'"),
    ("", {"SPLITEDGE_BROKR": "mqtt://h:1883"},  # a misspelt variable was ignored in silence (issue 56)
     "SPLITEDGE_BROKR: no splitedge role reads this variable (did you mean SPLITEDGE_BROKER?"),
])
def test_a_bad_setting_is_one_line_before_any_work(text: str, env: dict[str, str], says: str, tmp_path: Path,
                                                   monkeypatch, capsys) -> None:
    path = tmp_path / "run.toml"
    path.write_text(text)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["edge", "--config", str(path), "--broker", "mqtt://127.0.0.1:1", "--id", "e0"]) == 2
    err = capsys.readouterr().err
    assert says in err and err.startswith("splitedge edge: error:") and err.count("\n") == 1, err


def test_another_role_s_variable_is_left_alone(monkeypatch) -> None:
    """One env file may serve several roles: the cloud's SPLITEDGE_ROUNDS and a device's
    SPLITEDGE_EDGE do not stop an edge, nor do the variables that name no flag."""
    env = {"SPLITEDGE_ROUNDS": "3", "SPLITEDGE_EDGE": "e0", "SPLITEDGE_ARGS": "--threads 2",
           "SPLITEDGE_CACHE": "/tmp/cache", "SPLITEDGE_ID": "e1"}
    assert _parse("edge", ["--broker", "mqtt://h:1883"], monkeypatch, env=env).id == "e1"


def test_a_missing_config_file_is_named(tmp_path: Path, capsys) -> None:
    assert main(["cloud", "--config", str(tmp_path / "nope.toml")]) == 2
    assert f"--config {tmp_path / 'nope.toml'}: no such file" in capsys.readouterr().err


def test_help_shows_each_default_once(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["edge", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # help wraps its lines
    assert "(default: None)" not in out and out.count("(default: 0)") == 1  # --seed
    assert "(default: the system's CA store" in out and "store; env SPLITEDGE_CA_FILE) (default" not in out
