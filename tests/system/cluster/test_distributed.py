"""Training in two processes on CPU (DS_ACCELERATOR=cpu, gloo), started the way a user starts it:
`allattn-pipe run` sees `train.launcher.procs_per_node: 2` and runs the `deepspeed` launcher.

- ZeRO 1, 2 and 3 in two processes give the per-step losses of one process with ZeRO 0 at the
  same global batch (each rank computes half of the rows; DeepSpeed averages the gradients).
- kill -9 of the whole process tree mid-training, then a re-run: the losses after the resume
  are bit-identical to those of an uninterrupted run.
- `finetune.patience`: once validation stalls, train stops and the LR-drop phase takes over,
  with lr / 10 from the next step on and one continuous step axis in MLflow.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from quality.tiny_training import ADAM, STEPS, cli, tiny_config
from tests.fixtures.runs import metric_history

ROOT = Path(__file__).resolve().parents[3]
LONG = 80  # long enough that a signal sent at step 4 lands mid-training


def run_losses(tmp: Path, **kw) -> dict[int, float]:
    cfg = tiny_config(tmp, **kw)
    cli("run", cfg)
    exp = f"procs{kw['procs']}-zero{kw['zero']}-span{int(kw.get('adaptive_span', True))}"
    return metric_history(tmp / "runs", exp, "train", "loss")


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One workspace: download and preprocess once; each variant re-runs train."""
    return tmp_path_factory.mktemp("dist")


@pytest.fixture(scope="module")
def reference(shared):
    return run_losses(shared, procs=1, zero=0)


@pytest.mark.parametrize("zero", [1, 2])
def test_two_processes_zero_1_2_give_the_single_process_losses(shared, reference, zero):
    losses = run_losses(shared, procs=2, zero=zero)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    assert reference[STEPS] < reference[1] - 0.3  # it trains


def test_two_processes_zero_3_gives_the_single_process_losses(shared):
    # ZeRO 3 runs without adaptive span (the spec refuses the two together); evaluate then
    # reassembles the weights from the ranks' shards and must score what ZeRO 0 scores.
    def valid_bpc():
        return json.loads((shared / "runs" / "dist" / "evaluate" / "results.json").read_text())[
            "valid"
        ]["bpc"]

    shm_before = set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))
    reference = run_losses(shared, procs=1, zero=0, adaptive_span=False, evaluate=True)
    reference_bpc = valid_bpc()
    losses = run_losses(shared, procs=2, zero=3, adaptive_span=False, evaluate=True)
    assert valid_bpc() == pytest.approx(reference_bpc, rel=1e-5)
    # DeepSpeed's CPU all-reduce buffers (~69 MB per rank) are not left behind in /dev/shm
    assert set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")) <= shm_before
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return run_losses(tmp_path_factory.mktemp("whole"), procs=2, zero=2, optimizer=ADAM, steps=LONG)


@pytest.mark.parametrize("how", ["kill -9 every process", "SIGTERM to allattn-pipe"])
def test_interrupted_two_process_training_resumes_to_the_same_losses(tmp_path, uninterrupted, how):
    cfg = tiny_config(tmp_path, procs=2, zero=2, optimizer=ADAM, steps=LONG)
    ckpts = tmp_path / "runs" / "dist" / "train.partial" / "checkpoints"
    proc = cli("run", cfg, start_new_session=True)
    deadline = time.time() + 300
    while not (ckpts / "latest").exists() or "step-00000004" not in (ckpts / "latest").read_text():
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, "no checkpoint after 300 s"
        time.sleep(0.05)
    if how.startswith("kill"):
        # the runner, both deepspeed launchers and both ranks, at once
        everything = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(True)]
        for p in everything:
            p.kill()
        psutil.wait_procs(everything)
    else:
        proc.send_signal(signal.SIGTERM)  # passed on: the ranks save together, exit 143
        out = proc.communicate(timeout=120)[0]
        assert proc.returncode == 143, out
        assert "run the pipeline again to resume" in out
    assert not (tmp_path / "runs" / "dist" / "train").exists()
    out = cli("run", cfg).stdout
    resumed_at = int(re.search(r"resuming from step (\d+)", out).group(1))
    assert 4 <= resumed_at < LONG
    resumed = metric_history(tmp_path / "runs", "procs2-zero2-span1", "train", "loss")
    assert sorted(resumed) == list(range(1, LONG + 1))
    after = range(resumed_at + 1, LONG + 1)
    assert [resumed[s] for s in after] == [uninterrupted[s] for s in after]


def test_stalled_validation_starts_the_lr_drop(tmp_path):
    cfg = tmp_path / "patience.yaml"
    # Adam at lr 0.05 on this tiny model: validation improves for a few evaluations, then
    # stops; with patience 2 training ends there, well before train.steps.
    cfg.write_text(f"""\
extends: [{ROOT / "configs" / "quickstart.yaml"}]
name: patience
model: {{d_model: 32, n_layers: 2, n_heads: 2, n_persistent: 8, max_span: 64}}
train:
  steps: 400
  batch_size: 8
  seq_len: 32
  log_every: 1
  eval_every: 2
  eval_batches: 2
  optimizer: {{lr: 0.05, warmup_steps: 0}}
finetune: {{steps: 5, lr_divisor: 10, patience: 2}}
workspace: {{root: {tmp_path / "runs"}}}
stages: [download, preprocess, train, finetune]
""")
    out = cli("run", cfg).stdout
    lr = metric_history(tmp_path / "runs", "patience", "train", "lr")
    ft_lr = metric_history(tmp_path / "runs", "patience", "finetune", "lr")
    valid = metric_history(tmp_path / "runs", "patience", "train", "valid_bpc")
    stop = max(lr)
    assert stop < 400 and "has not improved for 2 evaluations" in out

    def best_before(step):
        return min((v for s, v in valid.items() if s < step), default=float("inf"))

    # step stop-4 set a new best; the two validations after it did not beat the best before them
    assert sorted(valid)[-3:] == [stop - 4, stop - 2, stop]
    assert valid[stop - 4] < best_before(stop - 4)
    assert valid[stop - 2] >= best_before(stop - 2) and valid[stop] >= best_before(stop)
    assert sorted(lr) + sorted(ft_lr) == list(range(1, stop + 6))  # continuous steps
    assert set(lr.values()) == {0.05}
    assert all(v == pytest.approx(0.005, rel=1e-12) for v in ft_lr.values())
