"""The world the stateful and signal fuzzers drive (quality/fuzzers/state_fuzz.py,
signal_fuzz.py): a tiny pipeline on a tiny local corpus, tracked to a real MLflow server
(quality/fuzzers/tracking_server.py), with two sweep points beside its workspace; and the
fork server that runs its commands as processes (quality/fuzzers/forkserver.py).

A worker builds its world once (a minute on 2 busy cores) and keeps snapshots of it,
`templates`: `clean` (every stage done and scored, the points too) and `backlog` (as clean,
but a forced train ran while the server went down, so the workspace holds a tracking
backlog that the store lacks). Each case starts from a snapshot restored at the same
absolute paths (the paths are in MLflow's tags), with a store of its own: MLflow caches an
open store per URI, so each case's store is a new file, never one replaced under a cache.
"""

from __future__ import annotations

import itertools
import random
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from quality.fuzzers.forkserver import Command, Ended, Zygote
from quality.fuzzers.tracking_server import TrackingServer

CONFIG = """\
name: tiny
dataset:
  name: local
  url: file://{corpus}
  tokenizer: {{kind: byte}}
  split: {{kind: tail, valid: 0.05, test: 0.05}}
  shards: {{block_tokens: 4096, blocks_per_shard: 4}}
model: {{kind: allattn, d_model: 16, n_layers: 1, n_heads: 2, n_persistent: 4, max_span: 16,
        adaptive_span: true, span_ramp: 4}}
train: {{steps: 4, batch_size: 2, seq_len: 16, log_every: 1, checkpoint_every: 2, eval_every: 2,
        eval_batches: 1,
        optimizer: {{type: adam, lr: 0.01, warmup_steps: 1, clip: global, clip_norm: 1.0}}}}
evaluate: {{splits: [valid, test], batch_size: 32}}
tracking: {{uri: "{url}", experiment: fuzz}}
workspace: {{root: {runs}}}
stages: [download, preprocess, train, evaluate]
"""
NAME = "tiny"
# the sweep whose points the world holds: --point lr0.02 / lr0.03 (their names end so)
POINT_GRID = "train.optimizer.lr=0.02,0.03"
WORDS = (
    "the quick brown fox jumps over a lazy dog while seven small birds sing in tall green "
    "trees and one cat sits on the warm mat"
).split()


def corpus_text() -> str:
    """About 11 kB of lines of words (bytes: 29 symbols), the same in every world."""
    draw = random.Random(1)
    return "".join(" ".join(draw.choice(WORDS) for _ in range(8)) + ".\n" for _ in range(300))


def command_env(jobs: int) -> dict[str, str]:
    """The commands' environment: this one without a tracking variable, a process group's
    variables or a proxy (the server is on the loopback), on the CPU; one thread each when
    several workers share the cores."""
    from pipeline.cluster.distributed import environment_for_new_group

    env = environment_for_new_group()
    for var in list(env):
        if var.startswith(("MLFLOW_", "_MLFLOW_")) or var.lower() in (
            "http_proxy",
            "https_proxy",
            "all_proxy",
        ):
            del env[var]
    env.update(DS_ACCELERATOR="cpu", no_proxy="127.0.0.1,localhost", NO_PROXY="127.0.0.1")
    if jobs > 1:
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


@dataclass
class Driven:
    """A command driven by `World.drive`: how it ended, when the signal was sent (monotonic;
    None: not sent, the command had ended first), its window (wall clock, seconds), and when
    it was ready (monotonic: the signal's time is counted from there)."""

    ended: Ended
    sent: float | None
    start: float
    end: float
    ready: float


@dataclass
class World:
    """One worker's world under `root`: corpus.txt, tiny.yaml, runs/ (the workspace root),
    server/<case>/ (each case's store), templates/<name>/ (the snapshots), out/ (the
    commands' stdout and stderr)."""

    root: Path
    server: TrackingServer
    zygote: Zygote
    templates: dict[str, Path] = field(default_factory=dict)
    counter: itertools.count = field(default_factory=itertools.count)

    @property
    def config(self) -> Path:
        return self.root / "tiny.yaml"

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    @property
    def workspace(self) -> Path:
        return self.runs / NAME

    @property
    def exports(self) -> Path:
        """Where the cases export to (`--out exports/NAME`)."""
        return self.root / "exports"

    def start(self, args: list[str], label: str = "cmd") -> Command:
        """`allattn-pipe ARGS` as a process, in the world's root."""
        out = self.root / "out" / f"{next(self.counter):06d}-{label}"
        return self.zygote.start(args, self.root, out)

    def run(self, args: list[str], timeout: float = 300) -> Ended:
        return self.start(args).wait(timeout)

    def drive(
        self,
        args: list[str],
        label: str,
        signum: int | None = None,
        signal_at: float = 0.0,
        down_at: float | None = None,
        timeout: float = 300,
    ) -> Driven:
        """Run a command; `signal_at` seconds after it is ready send it `signum` (SIGINT to
        its process group, as ctrl-C; the others to it, as `kill` and a scheduler do), and
        `down_at` seconds after, stop the server (started again once the command ended)."""
        events = []
        if signum is not None:
            events.append((signal_at, "signal"))
        if down_at is not None:
            events.append((down_at, "down"))
        start = time.time()
        command = self.start(args, label)
        sent = None
        for at, what in sorted(events):
            while command.running() and time.monotonic() < command.ready + at:
                time.sleep(min(0.01, max(0.0, command.ready + at - time.monotonic())))
            if not command.running():
                break
            if what == "down":
                self.server.stop()
            else:
                assert signum is not None
                sent = command.signal(signum, group=signum == signal.SIGINT)
        ended = command.wait(timeout)
        end = time.time()
        if not self.server.up:
            self.server.start()
        return Driven(ended, sent, start, end, command.ready)

    def down_once(self, command: Command, printed: str, timeout: float = 300) -> None:
        """Stop the server once `command` has printed `printed` (or ended)."""
        deadline = time.monotonic() + timeout
        out = command.out_dir / "stdout"
        while command.running() and time.monotonic() < deadline:
            if printed in out.read_text(errors="replace"):
                break
            time.sleep(0.02)
        self.server.stop()

    def snapshot_backlog(self) -> None:
        """Template `backlog`: `clean` after a forced train whose server went down as the
        stage began (its records, and evaluate's, kept in the workspace's backlog)."""
        self.restore("clean")
        command = self.start(["run", str(self.config), "--force", "train"])
        self.down_once(command, "[train] running")
        done = command.wait(300)
        backlog = self.workspace / "tracking-backlog.jsonl"
        if done.exit_code != 0 or not backlog.is_file():
            raise RuntimeError(
                f"building the backlog template: exit {done.shell_code}, backlog "
                f"{'there' if backlog.is_file() else 'missing'}:\n{done.stderr[-2000:]}"
            )
        self.snapshot("backlog")
        self.restore("clean")

    def snapshot(self, name: str) -> None:
        """Keep the workspace root and the store as template `name` (the server stopped)."""
        was_up = self.server.up
        self.server.stop()
        dest = self.root / "templates" / name
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(self.runs, dest / "runs", symlinks=True)
        shutil.copy2(self.server.root / "server.db", dest / "server.db")
        self.templates[name] = dest
        if was_up:
            self.server.start()

    def restore(self, name: str) -> None:
        """Template `name` back at runs/, its store a new file served from a new directory;
        the last case's store and outputs removed (and a fork server that died, replaced)."""
        self.server.stop()
        if self.zygote.proc.poll() is not None:
            self.zygote = Zygote(self.zygote.env)
        old = self.server.root
        shutil.rmtree(self.runs, ignore_errors=True)
        shutil.rmtree(self.exports, ignore_errors=True)  # what the last case exported
        shutil.copytree(self.templates[name] / "runs", self.runs, symlinks=True)
        self.server.root = self.root / "server" / f"case-{next(self.counter):06d}"
        self.server.root.mkdir(parents=True)
        shutil.copy2(self.templates[name] / "server.db", self.server.root / "server.db")
        if old.name.startswith("case-"):
            shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(self.root / "out", ignore_errors=True)
        self.server.start()

    def close(self) -> None:
        self.zygote.close()
        self.server.close()


def build_world(root: Path, jobs: int = 1, log=print) -> World:
    """A world under `root` with its `clean` and `backlog` templates."""
    for made in ("runs", "server", "templates", "out", "exports"):  # an earlier world's
        shutil.rmtree(root / made, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    (root / "corpus.txt").write_text(corpus_text())
    server = TrackingServer(root / "server" / "template")
    server.start()
    (root / "tiny.yaml").write_text(
        CONFIG.format(corpus=root / "corpus.txt", url=server.url, runs=root / "runs")
    )
    start = time.monotonic()
    world = World(root, server, Zygote(command_env(jobs)))
    log(f"fork server ready in {time.monotonic() - start:.0f} s")
    for args in (
        ["run", world.config],
        ["sweep", world.config, "--grid", POINT_GRID, "--parallel", "1"],
    ):
        done = world.run([str(a) for a in args], timeout=900)
        if done.exit_code != 0:
            raise RuntimeError(
                f"building the world: {args} exited {done.shell_code}:\n"
                f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
            )
    world.snapshot("clean")
    world.snapshot_backlog()
    log(f"world built in {time.monotonic() - start:.0f} s")
    return world
