"""The secret fuzzer: a canary secret put into every URL- and credential-valued place must
never be recorded or printed.

Each case makes a fresh canary (`CANARY-SECRET-<hex>`, then some of the characters the URL
grammar allows in a password or a query value: `'`, `!`, `$`, `(`, `)`, `*`, `+`, `,`, `;`,
`=`, `%XX`, and `&` where it stays inside a user's password, then `<hex>-END`; a leak is
either half in clear) and puts it where a credential goes
(never where a plain value goes: a path component is no secret): the password of
`user:PASSWORD@` and a whole `TOKEN@` user name, and credential-like query and fragment
parameters (token, sig, signature, api_key, password, client_secret, X-Amz-Signature /
X-Amz-Credential, X-Goog-Signature, access_token, ...), in `dataset.url` and `tracking.uri`
(as `--set` or written in the config); and into environment variables (MLFLOW_TRACKING_URI,
MLFLOW_TRACKING_PASSWORD, MLFLOW_TRACKING_TOKEN, AWS_SECRET_ACCESS_KEY, FOO_TOKEN,
http_proxy). The URLs point at a local server (quality/fuzzers/fuzz_kit.py `Server`) that
serves a small corpus, refuses (401, 500, 404), redirects, at a port nobody listens on, or
(tracking) at one that accepts and never answers.

Commands: validate, show, run (the download stage, in a copy of the world), run --dry-run,
compare, sweep --dry-run, sweep --slurm --dry-run, launch slurm (--dry-run and --output),
export, sample, sync, and runs of several processes in a copy of the world: `run, 2
processes` (the real deepspeed launcher and two ranks on this machine, download to train)
and `run, 2 nodes` (a hostfile of two nodes: the real deepspeed runner renders the command
line every node runs and hands it to the pdsh recorder, quality/fuzzers/fuzz_kit.py, which
runs it with the interpreter a recorder too; its records are searched like any file).
After each, the canary must be in none of: the output (click's and
file descriptors 1 and 2), any file under the world (workspace, MLflow store, artifacts,
logs, cache) or the case's directory (the configs the case wrote excepted). One exception,
by design: a batch script is the job's input as the config is, so the script `launch slurm`
/ `sweep --slurm` renders (and prints with --dry-run) may hold a secret given with `--set`.
A case also fails on a traceback, a refusal that is not one line, or a hang (30 s; 180 s for
two processes); when rank 0 stops with its one error line before training, the other rank
says so in one line too (issue 45 item 7): its gloo traceback is a failure like any other.
Used by tests/system/commands/test_fuzz_classes.py and quality/fuzz.py --secrets N.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import strategies as st

from quality.fuzzers.cli_fuzz import World, copy_world
from quality.fuzzers.fuzz_kit import CORPUS_SHA256, Recorders, Server, derandomized, invoke

# {c}: the canary; {h}: 127.0.0.1:PORT of the server; {closed}, {silent}: ports
DATA_URLS = [
    "http://{h}/corpus.txt?token={c}",
    "http://{h}/corpus.txt?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential={c}"
    "&X-Amz-Signature={c}",
    "http://{h}/corpus.txt?v=1&sig={c}",
    "http://{h}/corpus.txt?api_key={c}",
    "http://{h}/corpus.txt?password={c}&x=1",
    "http://{h}/corpus.txt?v=1;sig={c}",
    "http://{h}/corpus.txt?X-Goog-Signature={c}",
    "http://{h}/corpus.txt?client_secret={c}#access_token={c}",
    "http://user:{u}@{h}/corpus.txt",
    "http://{c}@{h}/corpus.txt",
    "https://user:{u}@example.invalid/data.txt",
    "http://{h}/denied?token={c}",
    "http://{h}/broken?Signature={c}",
    "http://{h}/missing.txt?AccessKey={c}",
    # redirected to a URL that holds the secret (the server puts it in, not our URL)
    "http://{h}/redirect?to=http://127.0.0.1:{closed}/x%3Ftoken%3DSECRET&token={c}",
    "http://{h}/redirect?to=ftp://u:SECRET@127.0.0.1/x&sig={c}",
    "http://{h}/redirect?to=http://u:SECRET@{h}/denied",
    "http://127.0.0.1:{closed}/corpus.txt?token={c}",
    "ftp://user:{c}@127.0.0.1/corpus.txt",
    "file:///nonexistent/corpus.txt?token={c}",
    "builtin://python-docs?token={c}",
    "http://user:{u}@{h}/corpus.txt?Token={c}",
]
TRACKING_URIS = [
    "http://user:{u}@127.0.0.1:{closed}",
    "http://user:{c}@127.0.0.1:{silent}",
    "http://user:{u}@{h}",
    "https://{c}@127.0.0.1:{closed}",
    "http://{h}/?token={c}",
]
ENV = {
    "MLFLOW_TRACKING_PASSWORD": "{c}",
    "MLFLOW_TRACKING_TOKEN": "{c}",
    "AWS_SECRET_ACCESS_KEY": "{c}",
    "FOO_TOKEN": "{c}",
    "MLFLOW_TRACKING_URI": "http://u:{c}@127.0.0.1:{closed}",
    "http_proxy": "http://u:{c}@{h}",
}
COMMANDS = (
    ["validate", "show", "run --dry-run", "compare", "sweep --dry-run", "sample", "sync"] * 2
    + ["run"] * 4
    + ["export", "sweep --slurm", "launch slurm", "launch slurm --output"]
    + ["run, 2 nodes", "run, 2 processes"]
)
SEVERAL = ("run, 2 nodes", "run, 2 processes")
# what a secret is made of between its two halves: the characters the URL grammar allows in
# a password or a query value (`&` only in a password: in a query it starts the next one)
GRAMMAR = ["'", "!", "$", "(", ")", "*", "+", ",", ";", "=", "%41", "%2F", "''"]


def quoted(value: str) -> str:
    """`value` as a single-quoted YAML scalar."""
    return "'" + value.replace("'", "''") + "'"


@dataclass
class Case:
    command: str
    args: list[str]
    canary: str  # the whole secret (the form in a query)
    env: dict[str, str | None] = field(default_factory=dict)
    copy: bool = False  # runs in a copy of the world (it writes)
    own: list[Path] = field(default_factory=list)  # files the case wrote (its configs)
    script: Path | None = None  # a rendered batch script: may hold a --set secret
    halves: tuple[str, str] = ("", "")  # the secret's two ends: a leak is either one


@dataclass
class Outcome:
    command: str
    args: list[str]
    exit_code: int | None
    seconds: float
    leaks: list[str]  # where the canary was found
    problem: str | None
    said: str = ""
    known: str | None = None  # a known defect seen, not counted as bad (none at present)


def draw_case(draw, world: World, tmp: Path, server: Server) -> Case:
    # random, not drawn: a draw repeats across cases, and a canary one case leaked into the
    # shared world would be found again in the next case that drew it
    left, right = f"CANARY-SECRET-{uuid.uuid4().hex[:16]}", f"{uuid.uuid4().hex[:16]}-END"
    middle = "".join(draw(st.lists(st.sampled_from(GRAMMAR), max_size=4)))
    canary = f"{left}{middle}{right}"
    in_password = f"{left}{middle}{draw(st.sampled_from(['', '&', '&a=b']))}{right}"
    server.secret = canary
    ports = {
        "c": canary,
        "u": in_password,
        "h": f"127.0.0.1:{server.port}",
        "closed": server.closed_port,
        "silent": server.silent_port,
    }
    command = draw(st.sampled_from(COMMANDS))
    copy = command in ("run", *SEVERAL)
    root = tmp / "world" if copy else world.root
    values: dict[str, str] = {}
    if draw(st.integers(0, 3)):
        values["dataset.url"] = draw(st.sampled_from(DATA_URLS)).format(**ports)
        if draw(st.integers(0, 3)):
            values["dataset.sha256"] = CORPUS_SHA256  # most downloads get through
    several = command in SEVERAL
    if several and "dataset.url" not in values:  # the ranks meet it (rank 0 downloads)
        values["dataset.url"] = draw(st.sampled_from(DATA_URLS)).format(**ports)
    if not several and (not values or draw(st.integers(0, 3)) == 0):
        # (a run of several processes starts only once its tracking server answered)
        values["tracking.uri"] = draw(st.sampled_from(TRACKING_URIS)).format(**ports)
    env: dict[str, str | None] = {
        k: ENV[k].format(**ports) for k in draw(st.lists(st.sampled_from(sorted(ENV)), max_size=3))
    }
    if "MLFLOW_TRACKING_URI" not in env or several:
        env["MLFLOW_TRACKING_URI"] = None
    config, own, sets = str(root / "tiny.yaml"), [], []
    if draw(st.integers(0, 2)) == 0:  # written in the config rather than given with --set
        written = tmp / "secret.yaml"
        lines = [f"extends: [{root / 'tiny.yaml'}]"]
        if "tracking.uri" in values:
            lines.append(f"tracking: {{uri: {quoted(values.pop('tracking.uri'))}}}")
        if "dataset.url" in values:
            url, sha = values.pop("dataset.url"), values.pop("dataset.sha256", None)
            lines.append(
                f"dataset: {{name: python_docs, url: {quoted(url)}, tokenizer: byte,"
                + (f" sha256: {sha}," if sha else "")
                + " split: {kind: tail, valid: 0.05, test: 0.05}}"
            )
        written.write_text("\n".join(lines) + "\n")
        config, own = str(written), [written]
    sets = [a for k, v in values.items() for a in ("--set", f"{k}={v}")]
    case = Case(command, [], canary, env, copy, own, halves=(left, right))
    if command in ("validate", "show", "sync", "sample", "export"):
        case.args = [command, config, *sets]
        if command == "sample":
            case.args += ["--prompt", "def ", "--tokens", "3"]
        if command == "export":
            case.args += ["--out", str(tmp / "export")]
            case.args += draw(st.sampled_from([[], ["--register", "fuzz-model"]]))
    elif command == "run, 2 nodes":
        hostfile = tmp / "hostfile"
        hostfile.write_text("node1 slots=1\nnode2 slots=1\n")
        case.args = ["run", config, *sets, "--set", "train.launcher.nodes=2"]
        case.args += ["--set", f"train.launcher.hostfile={hostfile}"]
        case.args += ["--set", f"train.seed={draw(st.integers(100, 10**6))}"]  # train runs
    elif command == "run, 2 processes":
        case.args = ["run", config, *sets, "--set", "train.launcher.procs_per_node=2"]
        case.args += ["--set", f"train.seed={draw(st.integers(100, 10**6))}"]  # train runs
        case.args += ["--only", "download", "--only", "preprocess", "--only", "train"]
    elif command in ("run", "run --dry-run"):
        case.args = ["run", config, *sets] + (["--only", "download"] if copy else ["--dry-run"])
    elif command == "compare":
        target = draw(st.sampled_from([config, "tiny"]))
        case.args = ["compare", target, *(sets if target == config else [])]
        case.args += draw(st.sampled_from([[], ["--format", "json"], ["--format", "csv"]]))
    elif command in ("sweep --dry-run", "sweep --slurm"):
        case.args = ["sweep", config, *sets, "--seeds", "1,2", "--dry-run"]
        if command == "sweep --slurm":
            case.args += ["--slurm", "--gpus-per-node", "0", "--procs-per-node", "1"]
    else:
        case.args = ["launch", "slurm", config, *sets, "--nodes", "1", "--gpus-per-node", "1"]
        if command == "launch slurm --output":
            case.script = tmp / "job.sbatch"
            case.args += ["--output", str(case.script)]
        else:
            case.args.append("--dry-run")
    return case


# ---------------------------------------------------------------- checking one


def _files(top: Path):
    for dirpath, _, filenames in os.walk(top):
        for name in filenames:
            p = Path(dirpath) / name
            if not p.is_symlink() and p.is_file():
                yield p


def leaks(case: Case, output: str, places: list[Path], scripts: bool) -> list[str]:
    """Where the canary is: 'output', or the files holding its bytes (`scripts`: but for
    rendered batch scripts)."""
    halves = [h for h in (case.canary, *case.halves) if h]
    found = ["output"] if any(h in output for h in halves) else []
    allowed = [case.script] if case.script and scripts else []
    if scripts:
        allowed += [p for top in places for p in (top / "runs").glob("*/slurm/*.sbatch")]
    for top in places:
        for p in _files(top):
            # the python recorder's copy of a rank's 0600 arguments file: the credentials
            # a rank needs, by design (pipeline/cluster/launcher.py, Launch)
            if p in case.own or p in allowed or p.name == "args-file.json":
                continue
            try:
                data = p.read_bytes()
            except OSError:
                continue
            if any(h.encode() in data for h in halves):
                found.append(str(p))
    return found


def run_case(case: Case, world: World, tmp: Path, rec: Recorders | None = None) -> Outcome:
    root = world.root
    if case.copy:
        root = copy_world(world, tmp / "world").root
    env = dict(case.env)
    places = [root, tmp]
    if case.command == "run, 2 nodes" and rec is not None:
        rec.reset()
        env.update(rec.env())
        places.append(rec.records)  # the command line each node ran, and its arguments
    timeout = 180 if case.command == "run, 2 processes" else 30
    inv = invoke(case.args, root, env, timeout=timeout)
    output = inv.output
    # a secret given with --set may be in the batch script rendered (the module's docstring)
    # (given in any of its forms: a password's may hold an `&` the query's does not)
    given = any(h in a for h in (case.canary, *case.halves) if h for a in case.args)
    scripts = case.command in ("sweep --slurm", "launch slurm", "launch slurm --output") and given
    if scripts and inv.exit_code == 0 and "--dry-run" in case.args:
        output = output.replace(inv.stdout, "")  # the script
    found = leaks(case, output, places, scripts)
    problem, known = inv.problem, None
    if found:
        problem = f"leak: the secret is in {', '.join(found[:4])}" + (
            f"; {problem}" if problem else ""
        )
    said = (inv.stderr.strip().splitlines() or [""])[-1][:300]
    for h in (case.canary, *case.halves):
        said = said.replace(h, "CANARY") if h else said
    return Outcome(case.command, case.args, inv.exit_code, inv.seconds, found, problem, said, known)


def fuzz_secrets(world: World, cases: int, on_outcome) -> None:
    """`cases` derandomized cases against one local server; read-only commands on `world`,
    `run` on a copy of it, each case with a temporary directory of its own."""
    import tempfile

    from quality.fuzzers.fuzz_kit import make_recorders

    server = Server()
    kit = tempfile.TemporaryDirectory()
    rec = make_recorders(Path(kit.name))
    try:

        def one(draw):
            with tempfile.TemporaryDirectory() as tmp:
                case = draw_case(draw, world, Path(tmp), server)
                start = time.monotonic()
                outcome = run_case(case, world, Path(tmp), rec)
                outcome.seconds = time.monotonic() - start
            shutil.rmtree(world.root / "runs" / "tiny" / "slurm", ignore_errors=True)
            on_outcome(outcome)

        derandomized(cases, one)
    finally:
        server.close()
        kit.cleanup()
