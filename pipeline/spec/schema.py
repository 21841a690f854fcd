"""The pipeline spec's schema: one pydantic section per block of the YAML file.

This module holds the whole `Spec` and its small blocks (tracking, workspace, paper); the
dataset card's sections are in dataset_schema.py, train's, finetune's and evaluate's in
training_schema.py, and what every section shares in section_base.py. Every section refuses
unknown keys and wrong types (strict: a quoted "4" is not an int). The `model:` section is
the exception: it is checked against the registered model's own config dataclass
(pipeline/models), so models stay plain torch. Loading, merging and error reporting are in
loading.py, yaml_reading.py and validation.py.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator

from pipeline.fsutil import path_problem
from pipeline.redact import mask
from pipeline.spec.dataset_schema import DatasetSpec
from pipeline.spec.section_base import Section, check_path
from pipeline.spec.training_schema import (
    CURRICULUM_ENGINE_TRAIN,
    CURRICULUM_UNUSED_TRAIN,
    EvaluateSpec,
    FinetuneSpec,
    TrainSpec,
)


class TrackingSpec(Section):
    """MLflow tracking of the runs: parameters, metrics and artifacts of every stage."""

    enabled: bool = Field(True, description="false: nothing is sent to MLflow")
    uri: str | None = Field(
        None,
        description="the MLflow tracking server or store; default: "
        "MLFLOW_TRACKING_URI, else sqlite file "
        "<workspace.root>/mlflow.db",
    )
    experiment: str | None = Field(
        None,
        description="the MLflow experiment the runs are recorded in; defaults to the spec's name",
    )

    @field_validator("uri")
    @classmethod
    def _reachable(cls, value: str | None) -> str | None:
        """An http(s) server's URI with a port that is no number, an unbalanced `[` or no
        host is refused here; MLflow would fail on it only once a run starts. A store
        (sqlite:, file:, a path) is its own scheme's to check."""
        from pipeline.data.fetch import url_problem

        if not value:
            return value
        if store := store_path(value):  # a store here: sqlite:, file:, a plain path
            if problem := path_problem(store):
                raise ValueError(f"the store's path: {problem}")
            return value
        problem = url_problem(value, schemes=("http", "https"))
        if problem and not problem.startswith(("unsupported scheme", "no scheme")):
            raise ValueError(problem)
        return value


def store_path(uri: str) -> str | None:
    """The path of the local MLflow store that a tracking URI names (sqlite:///PATH,
    file:PATH, or a plain path), or None for a server or another kind of store."""
    import urllib.parse

    scheme = uri.partition(":")[0].lower() if ":" in uri else ""
    if scheme in ("sqlite", "file"):
        return urllib.parse.unquote(urllib.parse.urlsplit(uri).path)
    # a plain path (a drive letter is no scheme); anything else names a kind of server
    if not scheme or len(scheme) == 1 or not scheme.isidentifier():
        return uri
    return None


class WorkspaceSpec(Section):
    """Where runs are kept on disk."""

    root: str = Field(
        "runs",
        description="holds each run's workspace <root>/<name> and the "
        "default MLflow store; relative to the current "
        "directory",
    )
    cache: str | None = Field(
        None, description="downloads cached by sha256, shared by every run; default <root>/cache"
    )

    @field_validator("root", "cache")
    @classmethod
    def _a_directory(cls, value: str | None) -> str | None:
        """A directory, or one that can be made: its nearest existing ancestor is one."""
        if value is None:
            return value
        check_path(value)
        path = Path(value)
        try:
            existing = next(p for p in (path, *path.parents) if p.exists())
        except OSError as e:  # a name too long for the filesystem, say
            raise ValueError(e.strerror) from None
        if not existing.is_dir():
            raise ValueError(f"{existing} is not a directory")
        return value


# what evaluate logs, under the names a paper row is written with
PAPER_METRICS = ("valid_bpc", "test_bpc", "valid_ppl", "test_ppl", "test_paper_loss")


class PaperSpec(Section):
    """A published result this config reproduces: `show` prints it, `compare` puts it beside
    the runs' numbers. Not part of any stage's fingerprint: it describes, it does not run."""

    table: str = Field(
        min_length=1, description="where it is published, e.g. 'Sukhbaatar et al. 2019, table 2'"
    )
    parameters: int | None = Field(
        None, gt=0, description="the published parameter count (none: the paper gives none)"
    )
    results: dict[Literal[PAPER_METRICS], float] = Field(  # type: ignore[valid-type]
        min_length=1, description="metric -> published value (valid is the paper's dev)"
    )


class Spec(Section):
    # the workspace directory's name: a file name has at most 255 bytes; `+` for a sweep
    # point's value (mixersa+conv), which a directory, a run name and a shell word all take
    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$",
        max_length=100,
        description="the run's name: its workspace <workspace.root>/<name> and "
        "default MLflow experiment",
    )
    dataset: DatasetSpec
    model: dict[str, Any] = Field(
        description="the model: `kind` names the family, the other "
        "keys are that family's config fields"
    )
    train: TrainSpec | None = None
    finetune: FinetuneSpec | None = None
    evaluate: EvaluateSpec = EvaluateSpec()
    tracking: TrackingSpec = TrackingSpec()
    workspace: WorkspaceSpec = WorkspaceSpec()
    paper: PaperSpec | None = None
    # names checked against the registered stage kinds (plugins included) in validation
    stages: list[str] = Field(
        min_length=1,
        description="the stages to run, in order; each after the stages whose outputs it reads",
    )

    _model_params: Any = PrivateAttr(None)
    _source: str = PrivateAttr("")

    @model_validator(mode="after")
    def _patience_needs_validation(self):
        if self.finetune and self.finetune.patience and not (self.train and self.train.eval_every):
            raise ValueError("finetune.patience counts validations: set train.eval_every")
        return self

    @model_validator(mode="after")
    def _lr_drop_needs_a_constant_lr(self):
        if (
            "finetune" in self.stages
            and self.train
            and self.train.optimizer.schedule != "linear_warmup"
        ):
            raise ValueError(
                f"the finetune stage divides a constant lr; train.optimizer."
                f"schedule {self.train.optimizer.schedule} decays it already: "
                f"drop finetune from stages or use schedule linear_warmup"
            )
        return self

    @model_validator(mode="after")
    def _best_needs_validation(self):
        if (
            self.evaluate.checkpoint == "best"
            and "evaluate" in self.stages
            and not (self.train and self.train.eval_every)
        ):
            raise ValueError(
                "evaluate.checkpoint best is the checkpoint of the best "
                "validation: set train.eval_every"
            )
        return self

    @property
    def model_kind(self) -> str:
        return self.model["kind"]

    @property
    def model_params(self):
        """The model section as the model's own config dataclass."""
        return self._model_params

    @property
    def source(self) -> str:
        return self._source

    @property
    def workspace_dir(self) -> Path:
        return Path(self.workspace.root) / self.name

    def build_model(self, vocab_size: int, origin: str):
        """The spec's model for a vocabulary of `vocab_size` (from `origin`); a model that
        refuses it (adaptive_cutoffs past the vocabulary, say) is one line naming both."""
        from pipeline.errors import PipelineError
        from pipeline.models import build_model

        try:
            return build_model(self.model_kind, self.model_params, vocab_size)
        except ValueError as e:
            raise PipelineError(
                f"{self.source}: model: {e} (vocabulary {vocab_size} from {origin})"
            ) from None

    def resolved(self) -> dict:
        """The spec as plain data, every default filled in: what `show` prints and MLflow keeps,
        so the credentials of its URLs are masked (pipeline.redact)."""
        out = self.model_dump(mode="json")
        out["dataset"] = self.dataset.resolved()
        out["model"] = {"kind": self.model_kind, **asdict(self.model_params)}
        for path, _ in self.inert_keys():  # they would be refused when read back
            parent = out
            for part in path[:-1]:
                parent = parent[part]
            parent.pop(path[-1], None)
        return mask(out)

    def inert_keys(self) -> list[tuple[tuple[str, ...], str]]:
        """The keys that do nothing under this spec's other settings, each with why. Written
        in the config being run (or by --set) they are refused; inherited from a shared base
        that a variant switches off, they are accepted (pipeline.spec)."""
        out = []
        opt = self.train.optimizer if self.train else None
        params = self.model_params
        curriculum = "curriculum" in self.stages
        for applies, keys, why in (
            (
                curriculum,
                CURRICULUM_UNUSED_TRAIN,
                "the curriculum stage's epochs, lengths and checkpoints are set by "
                "dataset.generator.algorithmic.curriculum",
            ),
            (
                curriculum,
                CURRICULUM_ENGINE_TRAIN,
                "the curriculum stage trains in one process on a float32 engine without ZeRO",
            ),
            (
                curriculum,
                tuple(f"evaluate.{key}" for key in EvaluateSpec.model_fields),
                "an algorithmic task is scored on generated cases at the curriculum's lengths",
            ),
            (
                opt and opt.type == "adagrad",
                ("train.optimizer.betas",),
                "betas are Adam's moment decays; adagrad has none",
            ),
            (
                opt and opt.type == "adagrad" and opt.clip == "per_param",
                ("train.optimizer.weight_decay",),
                "the paper's Adagrad (clip: per_param) has no weight decay",
            ),
            (opt and opt.clip == "none", ("train.optimizer.clip_norm",), "clip is none"),
            (
                self.train and self.train.nonfinite == "stop",
                ("train.nonfinite_limit",),
                "train.nonfinite is stop: the first non-finite update stops training",
            ),
        ):
            if applies:
                out += [(tuple(key.split(".")), why) for key in keys]
        # each model kind's config knows its own; a plugin's config may have none
        if params is not None and hasattr(params, "inert_keys"):
            out += [(("model", key), why) for key, why in params.inert_keys()]
        return out

    def inert_defaults(self) -> dict[str, object]:
        """The inert keys of the pipeline's sections (inert_keys; the model's are left out of
        its resolved section), dotted, each with its default as JSON: the value a stage's
        fingerprint counts for it, whatever a base sets, so that an unset one hashes as it
        always did and editing one changes nothing."""
        out = {}
        for path, _ in self.inert_keys():
            section: Any = self
            for part in path[:-1]:
                section = getattr(section, part, None)
            if isinstance(section, BaseModel):
                default = (
                    type(section).model_fields[path[-1]].get_default(call_default_factory=True)
                )
                out[".".join(path)] = (
                    default.model_dump(mode="json") if isinstance(default, BaseModel) else default
                )
        return out
