"""What a multi-process launch shows and sends (issue 45, items 1 and 2): a rank's error line
masks a URL's password as a one-process run's does; a multi-node launch, rendered by
deepspeed's own runner with pdsh and ssh replaced by recorders (nothing runs on the nodes),
sends no credential and no `PYTHONPATH` naming the working directory on the command line it
prints and runs on every node, and imports nothing from that directory."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from tests.fixtures.planted import plant

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "configs" / "enwik8_large.yaml"
SECRET = "SeCrEt-pa'ss!$w(o)rd"


@pytest.mark.parametrize("error", ["PipelineError", "RuntimeError"])
def test_a_ranks_error_line_masks_the_url_it_names(monkeypatch, capsys, error):
    """What launch/train.py prints for a rank that fails (also into a Slurm job's log): one
    line for our errors, a traceback for others; a URL's password masked in both."""
    from pipeline.commands import launched
    from pipeline.errors import PipelineError

    said = f"tracking server http://user:{SECRET}@127.0.0.1:5000 is not answering"

    class Failing:
        def __init__(self, *args, **kw):
            pass

        def run(self, tracker):
            raise (PipelineError if error == "PipelineError" else RuntimeError)(said)

    monkeypatch.setattr(launched.distributed, "init_process_group", lambda: (0, 2))
    monkeypatch.setattr(launched, "make_tracker", lambda spec, rank: None)
    monkeypatch.setattr(launched, "Runner", Failing)
    code = launched.main(["--config", str(CONFIG)])
    err = capsys.readouterr().err
    assert "tracking server http://user:***@127.0.0.1:5000 is not answering" in err
    assert "SeCrEt" not in err
    if error == "PipelineError":
        assert (
            code == 2
            and err.startswith("error (rank 0): tracking server")
            and (err.count("\n") == 1)
        )
    else:
        assert code == 1 and "Traceback" in err


def test_each_rank_loads_the_spec_its_run_loaded(monkeypatch, tmp_path):
    """`run --smoke` on several processes: the ranks train the smoke model too, not the whole
    config (they were given the --set but not --smoke, and trained 1000 steps of the full
    quickstart where the run had planned 4 of a tiny model)."""
    from click.testing import CliRunner

    from pipeline.cluster import launcher
    from pipeline.commands import launched
    from pipeline.commands.cli import main

    sent: list[list[str]] = []
    monkeypatch.setattr(launcher, "run_under_launcher", lambda spec, args: sent.append(args))
    sets = ["--set", "train.launcher.procs_per_node=2", "--set", f"workspace.root={tmp_path}"]
    sets += ["--set", "tracking.enabled=false"]
    config = str(ROOT / "configs" / "quickstart.yaml")
    result = CliRunner().invoke(main, ["run", config, "--smoke", *sets])
    assert result.exit_code == 0, result.output
    planned = []

    class Recording:
        def __init__(self, spec, **kw):
            planned.append(spec)

        def run(self, tracker):
            pass

    monkeypatch.setattr(launched.distributed, "init_process_group", lambda: (0, 2))
    monkeypatch.setattr(launched, "make_tracker", lambda spec, rank: None)
    monkeypatch.setattr(launched, "Runner", Recording)
    assert launched.main(sent[0]) == 0
    (spec,) = planned
    assert (spec.name, spec.train.steps, spec.model_params.d_model) == ("quickstart-smoke", 4, 64)
    assert spec.train.launcher.procs_per_node == 2
    # a rank started by hand (deepspeed --module ... --config NAME) finds a config by name too
    monkeypatch.chdir(tmp_path)
    assert launched.main(["--config", "quickstart", "--smoke"]) == 0
    assert planned[1].name == "quickstart-smoke"


RECORDERS = {
    # pdsh -S -f N -w hosts WORD...: records the line each node's shell would run, and the
    # file that line names (read while the launch runs); runs nothing
    "pdsh": """\
        import os, re, shutil, sys
        log = os.environ["FAKE_LOG"]
        args = sys.argv[1:]
        while args and args[0].startswith("-"):
            flag = args.pop(0)
            if flag in ("-f", "-w"):
                args.pop(0)
        line = " ".join(args)
        with open(os.path.join(log, "pdsh.line"), "w") as f:
            f.write(line)
        named = re.search(r"--args-file (\\S+)", line)
        if named:
            shutil.copy(named.group(1), os.path.join(log, "args.json"))
        """,
    "ssh": "print('127.0.0.1')\n",  # the runner's reachability and address checks
}


def test_a_multi_node_launch_sends_no_secret_and_no_working_directory(tmp_path, monkeypatch, capfd):
    from pipeline.cluster import launcher
    from pipeline.spec import load_spec

    bin_dir, log, here = tmp_path / "bin", tmp_path / "log", tmp_path / "here"
    for d in (bin_dir, log, here):
        d.mkdir()
    for name, body in RECORDERS.items():
        (bin_dir / name).write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
        (bin_dir / name).chmod(0o755)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("nodeA slots=1\nnodeB slots=1\n")
    marker = plant(here)
    monkeypatch.chdir(here)
    spec = load_spec(
        CONFIG,
        ["train.launcher.nodes=2", "train.launcher.procs_per_node=1"]
        + [f"train.launcher.hostfile={hostfile}", f"workspace.root={tmp_path / 'runs'}"],
    )
    tracking = f"http://user:{SECRET}@127.0.0.1:5000"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW", "PYTHON"))}
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}",
        FAKE_LOG=str(log),
        DS_ACCELERATOR="cpu",
        MLFLOW_TRACKING_URI=tracking,
        MLFLOW_TRACKING_TOKEN=SECRET,
        PYTHONPATH=f"{here}{os.pathsep}{ROOT}",  # the user's own, naming where they stand
    )
    monkeypatch.setattr(os, "environ", env)
    args = ["--config", str(CONFIG), "--set", f"dataset.url=http://u:{SECRET}@h/x"]
    lines: list[str] = []
    launcher.run_under_launcher(spec, args, log=lines.append)
    out, err = capfd.readouterr()
    remote = (log / "pdsh.line").read_text()
    printed = "\n".join([*lines, out, err])
    assert "cmd = " in printed  # deepspeed's own line, masked
    assert "SeCrEt" not in remote and "SeCrEt" not in printed, (remote, printed)
    assert f"{here}:" not in remote and f" {here};" not in remote, remote  # PYTHONPATH, cd
    assert "export PYTHONSAFEPATH=1;" in remote, remote
    assert not marker.exists(), marker.read_text()
    # the ranks get the arguments and the credentials from a file only its owner reads,
    # removed once the launch is over
    carried = json.loads((log / "args.json").read_text())
    assert carried["args"] == ["--workdir", str(here), *args]
    assert carried["env"]["MLFLOW_TRACKING_URI"] == tracking
    assert carried["env"]["MLFLOW_TRACKING_TOKEN"] == SECRET
    assert not list((tmp_path / "runs").rglob(".launch-*"))
