"""The spec: extends, dataset cards, typed --set overrides, and errors that point at the line."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.commands.cli import main
from pipeline.spec import SpecError, load_spec
from pipeline.workspace.layout import fingerprint
from stages import STAGES

ROOT = Path(__file__).resolve().parents[3]

BASE = """\
name: tiny
dataset: python_docs
model:
  kind: allattn
  d_model: 32
  n_layers: 2
  n_heads: 2
  n_persistent: 8
  max_span: 64
train:
  steps: 4
  batch_size: 2
  seq_len: 16
  optimizer: {type: adam, lr: 1.0e-3, clip: global, clip_norm: 1.0}
finetune:
  steps: 2
stages: [download, preprocess, train, finetune, evaluate]
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def error_of(path, overrides=()) -> str:
    with pytest.raises(SpecError) as info:
        load_spec(path, list(overrides))
    return str(info.value)


def test_quickstart_is_valid_and_resolves_its_card():
    spec = load_spec(ROOT / "configs" / "quickstart.yaml")
    assert spec.dataset.name == "python_docs"
    assert spec.dataset.url == "builtin://python-docs"
    assert spec.model_kind == "allattn"
    assert spec.model_params.n_persistent == 32
    assert spec.stages == ["download", "preprocess", "train", "finetune", "evaluate"]


def test_misspelt_key_names_file_line_path_and_suggestion(tmp_path):
    cfg = write(tmp_path, "bad.yaml", BASE.replace("  n_layers: 2", "  n_layer: 2"))
    msg = error_of(cfg)
    assert f"{cfg}:6: model.n_layer: unknown key 'n_layer' (did you mean 'n_layers'?)" in msg


def test_misspelt_key_in_a_spec_section(tmp_path):
    cfg = write(tmp_path, "bad.yaml", BASE.replace("  seq_len: 16", "  seqlen: 16"))
    msg = error_of(cfg)
    assert f"{cfg}:13: train.seqlen: unknown key 'seqlen' (did you mean 'seq_len'?)" in msg


def test_string_where_an_int_belongs_says_expected_and_found(tmp_path):
    cfg = write(tmp_path, "bad.yaml", BASE.replace("n_layers: 2", "n_layers: two"))
    msg = error_of(cfg)
    assert f"{cfg}:6: model.n_layers: expected a valid integer; found 'two' (a string)" in msg


def test_quoted_number_is_not_silently_converted(tmp_path):
    cfg = write(tmp_path, "bad.yaml", BASE.replace("steps: 4", "steps: '4'"))
    assert "train.steps: expected a valid integer; found '4' (a string)" in error_of(cfg)


def test_all_errors_are_reported_at_once(tmp_path):
    text = BASE.replace("n_layers: 2", "n_layers: two").replace("seq_len: 16", "seq_len: -1")
    msg = error_of(write(tmp_path, "bad.yaml", text))
    assert "model.n_layers" in msg and "train.seq_len" in msg


def test_missing_required_key(tmp_path):
    cfg = write(tmp_path, "bad.yaml", BASE.replace("  steps: 4\n", "", 1))
    assert f"{cfg}:10: train.steps: required key is missing" in error_of(cfg)


def test_model_config_cross_field_check_is_a_spec_error(tmp_path):
    cfg = write(tmp_path, "bad.yaml", BASE.replace("n_heads: 2", "n_heads: 3"))
    msg = error_of(cfg)
    assert msg.startswith(f"{cfg}:3: model:") and "n_heads" in msg


def test_unknown_model_kind_suggests(tmp_path):
    cfg = write(tmp_path, "bad.yaml", BASE.replace("kind: allattn", "kind: allatn"))
    assert "model.kind: unknown model kind 'allatn' (did you mean 'allattn'?)" in error_of(cfg)


def test_unknown_dataset_card_suggests(tmp_path):
    cfg = write(tmp_path, "bad.yaml", BASE.replace("dataset: python_docs", "dataset: python_doc"))
    msg = error_of(cfg)
    assert "no dataset card named 'python_doc' (did you mean 'python_docs'?)" in msg


def test_stage_order_is_checked(tmp_path):
    cfg = write(
        tmp_path,
        "bad.yaml",
        BASE.replace(
            "[download, preprocess, train, finetune, evaluate]", "[download, train, preprocess]"
        ),
    )
    assert "'train' reads the output of 'preprocess', which must come before it" in error_of(cfg)


def test_per_param_clipping_is_refused_with_adam(tmp_path):
    cfg = write(tmp_path, "bad.yaml", BASE.replace("clip: global", "clip: per_param"))
    assert "per_param" in error_of(cfg)


def test_per_param_clipping_is_accepted_with_adagrad_in_every_zero_stage(tmp_path):
    cfg = write(
        tmp_path,
        "ok.yaml",
        BASE.replace("type: adam", "type: adagrad").replace("clip: global", "clip: per_param"),
    )
    for stage in (0, 1, 2, 3):
        # (ZeRO 3 is refused with adaptive spans for a reason of its own)
        spec = load_spec(cfg, [f"train.deepspeed.zero_stage={stage}", "model.adaptive_span=false"])
        assert spec.train.optimizer.clip == "per_param"


def test_set_overrides_are_typed(tmp_path):
    cfg = write(tmp_path, "ok.yaml", BASE)
    spec = load_spec(
        cfg,
        [
            "train.optimizer.lr=0.05",
            "model.n_layers=12",
            "train.optimizer.warmup_steps=3",
            "tracking.enabled=false",
            "model.span_loss_coef=2e-7",
        ],
    )
    assert spec.train.optimizer.lr == 0.05 and isinstance(spec.train.optimizer.lr, float)
    assert spec.model_params.n_layers == 12
    assert spec.tracking.enabled is False
    assert spec.model_params.span_loss_coef == 2e-7


def test_set_reaches_into_a_dataset_card(tmp_path):
    cfg = write(tmp_path, "ok.yaml", BASE)
    spec = load_spec(cfg, ["dataset.url=file:///data/enwik8.zip", "dataset.split.valid=1000"])
    assert spec.dataset.url == "file:///data/enwik8.zip"
    assert spec.dataset.split.valid == 1000
    assert spec.dataset.name == "python_docs"  # the rest of the card is kept


def test_bad_set_names_the_override(tmp_path):
    cfg = write(tmp_path, "ok.yaml", BASE)
    msg = error_of(cfg, ["model.n_layer=3"])
    assert msg.startswith("--set model.n_layer=3: model.n_layer: unknown key")
    assert "did you mean 'n_layers'" in msg
    assert "expected KEY=VALUE" in error_of(cfg, ["train.lr"])


def test_extends_merges_in_order_and_keeps_locations(tmp_path):
    write(tmp_path, "base.yaml", BASE)
    write(
        tmp_path,
        "mid.yaml",
        """\
        model:
          n_layers: 3
        train:
          steps: 10
        """,
    )
    child = write(
        tmp_path,
        "child.yaml",
        """\
        extends: [base.yaml, mid.yaml]
        name: child
        train:
          steps: 20
        """,
    )
    spec = load_spec(child)
    assert spec.name == "child"
    assert spec.model_params.n_layers == 3  # from mid
    assert spec.model_params.d_model == 32  # from base
    assert spec.train.steps == 20  # the file itself wins
    assert spec.train.batch_size == 2  # merged, not replaced
    bad = write(
        tmp_path,
        "bad.yaml",
        """\
        extends: [base.yaml]
        model:
          n_persistant: 4
        """,
    )
    assert f"{bad}:3: model.n_persistant: unknown key" in error_of(bad)
    # an error in a parent is reported at the parent's line
    write(tmp_path, "badbase.yaml", BASE.replace("n_heads: 2", "n_heads: x"))
    kid = write(tmp_path, "kid.yaml", "extends: [badbase.yaml]\n")
    assert f"{tmp_path / 'badbase.yaml'}:7: model.n_heads" in error_of(kid)


def test_extends_cycle_and_missing_parent(tmp_path):
    write(tmp_path, "a.yaml", "extends: [b.yaml]\nname: a\n")
    write(tmp_path, "b.yaml", "extends: [a.yaml]\n")
    assert "cycle" in error_of(tmp_path / "a.yaml")
    missing = write(tmp_path, "m.yaml", "extends: [nope.yaml]\n")
    assert "extends: no such file" in error_of(missing)


def test_yaml_syntax_error_and_missing_file(tmp_path):
    bad = write(tmp_path, "bad.yaml", "name: x\nmodel: [unclosed\n")
    assert "not valid YAML" in error_of(bad)
    assert "no such file" in error_of(tmp_path / "absent.yaml")


def test_duplicate_key_is_an_error(tmp_path):
    bad = write(tmp_path, "dup.yaml", BASE + "name: again\n")
    assert "name: key given twice" in error_of(bad)


def cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "pipeline.commands.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_validate_reports_without_traceback(tmp_path):
    cfg = write(tmp_path, "bad.yaml", BASE.replace("  n_layers: 2", "  n_layer: 2"))
    result = cli("validate", str(cfg))
    assert result.returncode == 2
    assert "did you mean 'n_layers'" in result.stderr
    assert "Traceback" not in result.stderr
    debug = cli("--debug", "validate", str(cfg))
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_cli_show_prints_resolved_spec_and_parameter_count():
    result = cli("show", str(ROOT / "configs" / "quickstart.yaml"), "--set", "model.n_layers=2")
    assert result.returncode == 0, result.stderr
    assert "n_layers: 2" in result.stdout
    assert "url: builtin://python-docs" in result.stdout
    assert "parameters: " in result.stdout


def test_cli_help_for_every_command():
    for command in ("run", "validate", "show", "stages"):
        result = cli(command, "--help")
        assert result.returncode == 0 and "Usage:" in result.stdout
    assert "preprocess" in cli("stages").stdout


# configs/base holds fragments that pipelines extend, not pipelines
PIPELINE_CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if p.parent.name != "base")


def stage_fingerprints(spec) -> dict[str, str]:
    return {name: fingerprint(STAGES[name].config(spec), {}) for name in spec.stages}


@pytest.mark.parametrize(
    "config, overrides",
    [(p, ()) for p in PIPELINE_CONFIGS]
    # a generated dataset (no url, tokenizer or split) and a sentencepiece tokenizer
    + [
        (ROOT / "configs" / "quickstart.yaml", ("--set", "dataset=sort_synthetic")),
        (
            ROOT / "configs" / "quickstart.yaml",
            ("--set", "dataset.tokenizer={kind: sentencepiece, vocab_size: 111}"),
        ),
    ],
    ids=lambda v: v.stem if isinstance(v, Path) else " ".join(v),
)
def test_show_prints_a_valid_spec_with_the_same_fingerprints(config, overrides, tmp_path):
    result = CliRunner().invoke(main, ["show", str(config), *overrides])
    assert result.exit_code == 0, result.output
    printed_spec = result.output.split("\n\nparameters:")[0]
    copy = tmp_path / "copy.yaml"
    copy.write_text(printed_spec)
    original = load_spec(config, list(overrides[1::2]))
    reloaded = load_spec(copy)
    assert reloaded.resolved() == original.resolved()
    assert stage_fingerprints(reloaded) == stage_fingerprints(original)


LAUGHS = "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 10))


@pytest.mark.parametrize(
    "replace, by, error",
    [
        ("n_layers: 2", "n_layers: !!int abc", ":6: model.n_layers: 'abc' is not a valid !!int"),
        (
            "n_layers: 2",
            "n_layers: " + "9" * 5000,
            ":6: model.n_layers: '" + "9" * 56 + "... is not a valid !!int",
        ),
        (
            "n_layers: 2",
            "n_layers: !!bool maybe",
            ":6: model.n_layers: 'maybe' is not a valid !!bool",
        ),
        (
            "name: tiny",
            "name: !!timestamp 2020-99-99",
            ":1: name: '2020-99-99' is not a valid !!timestamp",
        ),
        # text that the tag's pattern does not match fails inside PyYAML's constructor
        (
            "name: tiny",
            "name: !!timestamp notadate",
            ":1: name: 'notadate' is not a valid !!timestamp",
        ),
        ("n_layers: 2", "n_layers: !!int ''", ":6: model.n_layers: '' is not a valid !!int"),
        ("n_layers: 2", "n_layers: !!float ''", ":6: model.n_layers: '' is not a valid !!float"),
        (
            "name: tiny",
            "name: !!merge x",
            ":1: name: could not determine a constructor for the tag 'tag:yaml.org,2002:merge'",
        ),
        # a tag on a mapping or a list is refused, never dropped for the plain collection
        (
            "n_layers: 2",
            "n_layers: !!str [2]",
            ":6: model.n_layers: the tag !!str on a list is not supported; a spec's "
            "mappings and lists are plain ones",
        ),
        (
            "model:",
            "model: !!python/object:os.system",
            ":3: model: the tag !!python/object:os.system on a mapping is not supported; a spec's "
            "mappings and lists are plain ones",
        ),
        (
            "name: tiny",
            "name: !!set {a, b}",
            ":1: name: the tag !!set on a mapping is not supported; a spec's "
            "mappings and lists are plain ones",
        ),
        (
            "name: tiny",
            "name: tiny\n{[1]: 2}: 3",
            ":2: (top level): a key must be a name, found a mapping",
        ),
        (
            "  n_layers: 2",
            "  n_layers: 2\n  <<: {n_heads: 4}",
            ":7: model: merge keys (<<) are not supported; share settings between files with "
            "`extends`",
        ),
        (
            "name: tiny",
            "name: " + "[" * 5000 + "]" * 5000,
            ":1: not valid YAML: nested more than 64 levels deep",
        ),
        (
            "name: tiny",
            "name: &a [*a]",
            ":1: nested more than 64 levels deep (an alias inside its own anchor?)",
        ),
        (
            "name: tiny",
            "name: tiny\nl0: &l0 [lol, lol]\n" + LAUGHS,
            ":2: more than 10,000 values once YAML aliases are expanded; a spec has hundreds",
        ),
        (
            "kind: allattn",
            "kind: [allattn]",
            ":4: model.kind: expected the name of a model kind, "
            "found ['allattn'] (a list); known: active_memory, "
            "allattn, infinity_former",
        ),
        (
            "name: tiny",
            "name: " + "n" * 300,
            ":1: name: string should have at most 100 "
            "characters; found '" + "n" * 56 + "... (a string)",
        ),
        (
            "dataset: python_docs",
            "dataset: " + "d" * 300,
            ":2: dataset: '"
            + "d" * 56
            + "... is not a dataset card's name (letters, digits, _ . -, "
            "at most 100 characters) nor a mapping",
        ),
        (
            "  max_span: 64",
            "  max_span: 1000000000000000",
            ":9: model.max_span: at most 1,048,576 (the paper's models use up to 8,192); found "
            "1000000000000000 (an integer)",
        ),
        (
            "  d_model: 32",
            "  d_model: 8000000000",
            ":5: model.d_model: at most 65,536 (the paper's models use 512 and 768); found "
            "8000000000 (an integer)",
        ),
        # aliases within the bounds still work
        ("  n_heads: 2\n  n_persistent: 8", "  n_heads: &h 2\n  n_persistent: *h", None),
    ],
)
def test_broken_yaml_is_one_located_error(tmp_path, replace, by, error):
    path = write(tmp_path, "spec.yaml", BASE.replace(replace, by, 1))
    with time_limit(seconds=10):  # the alias cases used to hang
        if error is None:
            load_spec(path)
        else:
            assert error_of(path) == f"{path}{error}"


@contextlib.contextmanager
def time_limit(seconds: int):
    def stop(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_unreadable_files_are_one_located_error(tmp_path):
    (tmp_path / "latin1.yaml").write_bytes(b"name: caf\xe9\n")
    assert (
        error_of(tmp_path / "latin1.yaml")
        == f"{tmp_path / 'latin1.yaml'}: not UTF-8 text: byte 0xe9 at offset 9"
    )
    child = write(tmp_path, "child.yaml", "extends: latin1.yaml\n" + BASE)
    assert error_of(child) == f"{tmp_path / 'latin1.yaml'}: not UTF-8 text: byte 0xe9 at offset 9"
    long_parent = write(tmp_path, "long.yaml", "extends: " + "p" * 300 + "\n" + BASE)
    assert error_of(long_parent) == (
        f"{long_parent}:1: cannot read "
        f"{repr(str(tmp_path / ('p' * 300)))[:57]}...: File name "
        f"too long"
    )


@pytest.mark.parametrize(
    "override, error",
    [
        (
            "dataset.split.valid=.inf",
            "dataset.split.valid: expected a finite number; found inf (a number)",
        ),
        (
            "dataset.vocab_size=1000000000000",
            "dataset.vocab_size: expected less than or equal to "
            "16777216; found 1000000000000 (an integer)",
        ),
        (
            "model.span_loss_coef=.nan",
            "model.span_loss_coef: expected a finite number; found nan (a number)",
        ),
        ("model.n_layers=!!int abc", "model.n_layers: 'abc' is not a valid !!int"),
        ("name=!!timestamp notadate", "name: 'notadate' is not a valid !!timestamp"),
    ],
)
def test_bad_numbers_and_tags_in_set_are_one_error(tmp_path, override, error):
    path = write(tmp_path, "spec.yaml", BASE)
    assert error_of(path, [override]) == f"--set {override}: {error}"


def test_show_refuses_a_model_the_vocabulary_cannot_hold_in_one_line(tmp_path):
    path = write(tmp_path, "spec.yaml", BASE)
    result = CliRunner().invoke(
        main, ["show", str(path), "--set", "model.adaptive_io=true", "--set", "model.d_model=128"]
    )
    assert result.exit_code == 2
    assert result.stderr == (
        f"error: {path}: model: adaptive_cutoffs [20000, 40000, 200000] need a vocabulary "
        f"larger than the last cutoff; vocab_size is 111 (vocabulary 111 from dataset card "
        f"'python_docs' (expected))\n"
    )


def test_show_with_a_workspace_root_too_long_for_the_filesystem_is_one_line(tmp_path):
    path = write(tmp_path, "spec.yaml", BASE)
    root = "w" * 300
    for command in ("validate", "show"):
        result = CliRunner().invoke(main, [command, str(path), "--set", f"workspace.root={root}"])
        assert result.exit_code == 2
        assert result.stderr.startswith(
            f"error: --set workspace.root={root}: workspace.root: its part '{'w' * 20}...' is "
            f"300 bytes long; a file or folder name has at most 255; found 'www"
        )
        assert result.stderr.count("\n") == 1


def test_an_extends_path_with_a_line_break_stays_one_line(tmp_path):
    # found by tests/system/spec/test_spec_fuzz.py: a YAML block scalar `|` gave extends a newline
    cfg = write(tmp_path, "spec.yaml", 'name: tiny\nextends: ["a\\nb.yaml"]\n')
    message = error_of(cfg)
    assert message == f"{cfg}:2: extends: no such file {tmp_path}/a\\nb.yaml"


@pytest.mark.parametrize(
    "config, key",
    [
        ("active_memory/sort.yaml", "dataset.generator.algorithmic.vocab"),
        ("infinity_former/sort_16k.yaml", "dataset.generator.frequency_sort.vocab"),
    ],
)
def test_a_task_vocabulary_no_machine_can_hold_is_refused_with_the_reason(config, key):
    override = f"{key}=1000000000"
    assert error_of(ROOT / "configs" / config, [override]) == (
        f"--set {override}: {key}: at most 16,777,214 symbols: with the separator and padding "
        f"they are the vocabulary, which the output layer scores at every position (the "
        f"papers' tasks use 20 to 100); found 1000000000 (an integer)"
    )


# ----------------------------------------------- checks the model would make at its first step

QUICKSTART = ROOT / "configs" / "quickstart.yaml"
SORT_CPU = ROOT / "configs" / "infinity_former" / "sort_4k_cpu.yaml"


def test_sdpa_with_attention_dropout_is_refused_before_training():
    msg = error_of(QUICKSTART, ["model.attention.impl=sdpa", "model.attn_dropout=0.1"])
    assert msg == (
        "--set model.attention.impl=sdpa: model.attention.impl: sdpa has no attention "
        "dropout (SDPA's own drops weights before the span mask), and this model trains "
        "with attn_dropout 0.1: "
        "use flex, reference or auto (or attn_dropout 0)"
    )
    load_spec(QUICKSTART, ["model.attention.impl=sdpa", "model.attn_dropout=0.0"])
    load_spec(
        QUICKSTART,
        ["model.attention.impl=sdpa", "model.attn_dropout=0.1", "stages=[download,preprocess]"],
    )  # nothing trains


def test_flex_training_on_an_explicit_cpu_is_refused():
    msg = error_of(QUICKSTART, ["model.attention.impl=flex", "train.device=cpu"])
    assert msg.startswith(
        "--set model.attention.impl=flex: model.attention.impl: flex runs forward only on CPU"
    )
    assert msg.endswith("and train.device is cpu: use reference, sdpa or auto to train on CPU")
    load_spec(QUICKSTART, ["model.attention.impl=flex", "train.device=cuda"])


def test_triton_training_on_an_explicit_cpu_is_refused():
    msg = error_of(QUICKSTART, ["model.attention.impl=triton", "train.device=cpu"])
    assert msg == (
        "--set model.attention.impl=triton: model.attention.impl: triton runs its kernels on "
        "CUDA (on the CPU only in Triton's interpreter, for tests: minutes a step) and "
        "train.device is cpu: use reference, sdpa or auto to train on CPU"
    )
    load_spec(QUICKSTART, ["model.attention.impl=triton", "train.device=cuda"])


def test_infinity_former_short_term_memory_shorter_than_a_segment_is_refused():
    spec = load_spec(SORT_CPU)
    assert spec.model_params.ltm and spec.model_params.mem_len == spec.train.seq_len
    longer = spec.train.seq_len + 1
    msg = error_of(SORT_CPU, [f"train.seq_len={longer}"])
    assert (
        f"model.mem_len {spec.model_params.mem_len} is shorter than train.seq_len {longer}" in msg
    )
    assert msg.endswith(f"make mem_len at least {longer}")
    msg = error_of(SORT_CPU, [f"evaluate.seq_len={longer}"])
    assert f"is shorter than evaluate.seq_len {longer}" in msg
    load_spec(SORT_CPU, [f"train.seq_len={longer}", "model.ltm=false"])  # no LTM: any length


@pytest.mark.parametrize(
    "key, value",
    [
        ("train.optimizer.lr", "1.0e+39"),
        ("train.optimizer.weight_decay", "1.0e+39"),
        ("train.optimizer.clip_norm", "5.0e+38"),
        ("model.span_loss_coef", "1.0e+39"),
    ],
)
def test_a_number_past_float32s_range_is_refused_by_validate_naming_the_key(tmp_path, key, value):
    """lr 1e39 was valid, then a traceback inside the optimizer (it is inf in float32)."""
    path = write(tmp_path, "big.yaml", BASE)
    result = CliRunner().invoke(main, ["validate", str(path), "--set", f"{key}={value}"])
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert "\n" not in line and f": {key}: beyond float32's range" in line, line


def test_a_number_too_small_for_float32_and_an_overflowing_finetune_lr_are_refused(tmp_path):
    path = write(tmp_path, "small.yaml", BASE)
    assert "train.optimizer.lr: too small for float32" in error_of(
        path, ["train.optimizer.lr=1.0e-50"]
    )
    err = error_of(path, ["train.optimizer.lr=1.0e+38", "finetune.lr_divisor=0.01"])
    assert "finetune.lr_divisor: train.optimizer.lr / finetune.lr_divisor = 1e+40 is beyond" in err


def test_under_fp16_a_model_number_past_65504_is_refused(tmp_path):
    path = write(tmp_path, "fp16.yaml", BASE)
    sets = ["train.deepspeed.fp16=true", "model.span_loss_coef=1.0e+5"]
    assert "model.span_loss_coef: beyond fp16's range (at most 65504" in error_of(path, sets)
    assert load_spec(path, ["model.span_loss_coef=1.0e+5"])  # float32 holds it


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", ".NaN"])
@pytest.mark.parametrize(
    "key", ["train.optimizer.lr", "finetune.lr_divisor", "model.attn_dropout", "betas"]
)
def test_nan_and_infinity_written_in_the_yaml_are_refused_naming_the_key(tmp_path, key, value):
    text = BASE.replace("lr: 1.0e-3", "lr: 1.0e-3, betas: [0.9, 0.99]")
    line = {
        "train.optimizer.lr": ("lr: 1.0e-3", f"lr: {value}"),
        "finetune.lr_divisor": ("  steps: 2\n", f"  steps: 2\n  lr_divisor: {value}\n"),
        "model.attn_dropout": ("  max_span: 64\n", f"  max_span: 64\n  attn_dropout: {value}\n"),
        "betas": ("betas: [0.9, 0.99]", f"betas: [0.9, {value}]"),
    }[key]
    path = write(tmp_path, "nan.yaml", text.replace(*line))
    err = error_of(path)
    name = "train.optimizer.betas.1" if key == "betas" else key
    assert f": {name}: expected a finite number" in err and "\n" not in err, err


def test_train_nonfinite_limit_does_nothing_under_stop(tmp_path):
    path = write(tmp_path, "limit.yaml", BASE)
    assert "train.nonfinite_limit" in error_of(path, ["train.nonfinite_limit=5"])
    spec = load_spec(path, ["train.nonfinite=skip", "train.nonfinite_limit=5"])
    assert (spec.train.nonfinite, spec.train.nonfinite_limit) == ("skip", 5)
