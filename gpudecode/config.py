"""The YAML config schema: typed, frozen sections validated with pydantic.

``load_config(path, overrides)`` reads a YAML file, applies ``a.b.c=value`` overrides, resolves
relative paths against the config file's folder and returns a frozen ``Config``. Every problem
(an unknown key, a wrong type, a bad choice) is one ``ConfigError`` whose message names the full
key path (``search.beam_size``, ``scorers[1].state_manager.type``) and lists the valid keys or
choices. Whether the files named in the config exist is checked separately by ``check_paths``,
so a config can be validated without its models at hand. Defaults come from
``gpudecode.defaults``, shared with the command line.
"""

from __future__ import annotations

import copy
import difflib
import os
import re
import types
import typing
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gpudecode import defaults
from gpudecode.io.features import BatchSizing
from gpudecode.search.registry import is_search_type, search_type_names
from gpudecode.states.options import STATE_MANAGER_TYPES

__all__ = [
    "Config", "ConfigError", "EncoderConfig", "EngineConfig", "FeaturesConfig", "FrontEndConfig",
    "IoConfig", "ModelsConfig", "RuntimeConfig", "ScorerConfig", "SearchConfig", "SearchTuningConfig",
    "StateManagerConfig",
    "VocabularyConfig", "apply_overrides", "check_paths", "dump_resolved", "load_config",
    "validate_config",
]


class ConfigError(ValueError):
    """A config that cannot be used. ``errors``: ``(key path, problem)`` pairs."""

    def __init__(self, message: str, errors: Sequence[tuple[str, str]] = ()):
        super().__init__(message)
        self.errors = list(errors)


class _KeyedError(ValueError):
    """Raised inside validators to point an error at a key below the validated object."""

    def __init__(self, key_path: Sequence[str | int], message: str):
        super().__init__(message)
        self.key_path = tuple(key_path)


# --- field types -------------------------------------------------------------------------------

def _non_empty_path(value: Any) -> Any:
    if isinstance(value, str) and not value.strip():
        raise ValueError("empty path")
    return value


def _resolve_path(path: Path, info: ValidationInfo) -> Path:
    """Relative paths resolve against ``context["base_dir"]`` (the config file's folder)."""
    path = path.expanduser()
    base_dir = (info.context or {}).get("base_dir")
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    return Path(os.path.normpath(path))


ConfigPath = Annotated[Path, BeforeValidator(_non_empty_path), AfterValidator(_resolve_path)]


def _resolve_folder(text: str, info: ValidationInfo) -> str:
    return str(_resolve_path(Path(text), info))


# A folder kept as text: resolved like a ConfigPath, but a place to look in, not a file whose
# content belongs to the run.
ConfigFolder = Annotated[str, BeforeValidator(_non_empty_path), AfterValidator(_resolve_folder)]
PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonPositiveFloat = Annotated[float, Field(le=0, allow_inf_nan=False)]
# a count where true/false would be a mistake (YAML reads "yes" as true): no bools, no floats
StrictPositiveInt = Annotated[int, Field(gt=0, strict=True)]
StrictNonNegativeInt = Annotated[int, Field(ge=0, strict=True)]


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected a label string or an index, not a boolean")
    return value


# A label given by its string or by its index in the vocabulary.
LabelSpec = Annotated[NonNegativeInt | Annotated[str, Field(min_length=1)],
                      BeforeValidator(_not_bool)]

_SCORER_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# --- sections ----------------------------------------------------------------------------------

class EngineConfig(_Section):
    """``runtime.engine``: where decoding runs: ``local`` (this process) or ``ray`` (a pool of
    decoder actors on a Ray cluster; see ``gpudecode.engines.ray_engine``). The other keys apply
    to ``ray`` only."""

    type: Literal[defaults.ENGINES] = defaults.ENGINE
    address: str | None = defaults.ENGINE_ADDRESS
    workers: PositiveInt | None = defaults.ENGINE_WORKERS
    gpus_per_worker: Annotated[float, Field(ge=0)] | None = defaults.GPUS_PER_WORKER
    cpus_per_worker: PositiveFloat = defaults.CPUS_PER_WORKER
    batches_per_shard: PositiveInt = defaults.BATCHES_PER_SHARD
    max_restarts: Annotated[int, Field(ge=-1)] = defaults.WORKER_MAX_RESTARTS
    max_task_retries: Annotated[int, Field(ge=-1)] = defaults.SHARD_MAX_RETRIES

    @field_validator("gpus_per_worker")
    @classmethod
    def _whole_or_fraction(cls, value: float | None) -> float | None:
        if value is not None and value > 1 and not float(value).is_integer():
            raise ValueError(f"{value} GPUs per worker: Ray takes a fraction of one GPU (e.g. 0.5 "
                             "for two workers sharing one) or a whole number")
        return value


class CudaGraphsConfig(_Section):
    """``runtime.cuda_graphs``: capture each decoder step in CUDA graphs, one per shape bucket
    (``true``/``false``, or these keys). See ``gpudecode.session.graphs.GraphOptions``."""

    enabled: bool | Literal["auto"] = defaults.CUDA_GRAPHS
    time_step: PositiveInt = defaults.GRAPH_TIME_STEP
    min_rows: PositiveInt = defaults.GRAPH_MIN_ROWS
    shared_buffers: bool = defaults.GRAPH_SHARED_BUFFERS
    warm_up_time: NonNegativeInt = defaults.GRAPH_WARM_UP_TIME
    resident_greedy: bool = defaults.GRAPH_RESIDENT_GREEDY
    shared_presents: bool = defaults.GRAPH_SHARED_PRESENTS

    @model_validator(mode="before")
    @classmethod
    def _from_bool(cls, data: Any) -> Any:
        return {"enabled": data} if isinstance(data, bool) or data == "auto" else data

    def to_options(self, enabled: bool | None = None, *, device: str = defaults.DEVICE):
        """The typed options a scorer takes; ``enabled`` overrides (a scorer's own switch);
        ``"auto"`` is on for ``device`` cuda."""
        from gpudecode.session.graphs import GraphOptions

        values = self.model_dump()
        if enabled is not None:
            values["enabled"] = enabled
        if values["enabled"] == "auto":
            values["enabled"] = device == "cuda"
            values["auto"] = True
        return GraphOptions(**values)


class RuntimeConfig(_Section):
    """Where and how models run."""

    device: Literal[defaults.DEVICES] = defaults.DEVICE
    device_id: NonNegativeInt = defaults.DEVICE_ID
    tf32: bool = defaults.TF32
    #: ONNX Runtime's XQA kernel for GroupQueryAttention decoding over a shared past/present buffer
    gqa_xqa: bool = defaults.GQA_XQA
    cuda_graphs: CudaGraphsConfig = Field(default_factory=CudaGraphsConfig)
    ort_arena_limit_bytes: PositiveInt | None = defaults.ORT_ARENA_LIMIT_BYTES
    cupy_pool_limit_bytes: PositiveInt | None = defaults.CUPY_POOL_LIMIT_BYTES  # CuPy's device memory pool
    cudnn_conv_algo_search: Literal[defaults.CUDNN_CONV_ALGO_SEARCHES] = (
        defaults.CUDNN_CONV_ALGO_SEARCH)
    dump_inputs: ConfigPath | None = None  # folder for .npz dumps of every model call's inputs
    #: batches read (and through the front end) ahead by a background thread; 0: read in the loop
    prefetch_batches: StrictNonNegativeInt = defaults.PREFETCH_BATCHES
    #: results queued for the writer thread (written and flushed there); 0: written in the loop
    writer_queue: StrictNonNegativeInt = defaults.WRITER_QUEUE
    #: results formatted and written by a child process; "auto": on for device cuda
    writer_process: bool | Literal["auto"] = defaults.WRITER_PROCESS
    #: decoding processes sharing the device (``gpudecode.engines.processes``); 1: this process
    processes: StrictPositiveInt = defaults.PROCESSES
    engine: EngineConfig = Field(default_factory=EngineConfig)

    @property
    def writes_in_child(self) -> bool:
        """Whether a child process formats and writes the results (``writer_process``)."""
        return self.device == "cuda" if self.writer_process == "auto" else self.writer_process

    @model_validator(mode="after")
    def _check_engine(self) -> RuntimeConfig:
        if self.cuda_graphs.enabled is True and self.device != "cuda":
            raise _KeyedError(["cuda_graphs", "enabled"], "CUDA graphs need runtime.device cuda")
        if self.processes > 1 and self.engine.type != "local":
            raise _KeyedError(["processes"], "several decoding processes are the local engine's; on "
                              "Ray set runtime.engine.workers (and gpus_per_worker) instead")
        if self.engine.type == "ray" and self.device == "cuda" and self.engine.gpus_per_worker == 0:
            raise _KeyedError(["engine", "gpus_per_worker"], "runtime.device is cuda, so each Ray "
                              "worker needs a GPU (or a fraction of one, e.g. 0.5)")
        return self


class EncoderLayoutConfig(_Section):
    """How the encoder takes its features (``session.EncoderLayout``): ``channels_first``
    ([U, F, T]), ``fixed_frames`` (every utterance exactly that many frames), ``lengths``
    (``inputs``: features-size in, encoder-states-size out; ``none``: no lengths, needs fixed_frames)."""

    channels_first: bool = False
    fixed_frames: PositiveInt | None = None
    lengths: Literal["inputs", "none"] = "inputs"

    @model_validator(mode="after")
    def _check(self) -> EncoderLayoutConfig:
        if self.lengths == "none" and self.fixed_frames is None:
            raise _KeyedError(["fixed_frames"], "an encoder without lengths (lengths: none) needs fixed_frames")
        return self


class EncoderConfig(_Section):
    path: ConfigPath
    io_map: dict[str, str] = Field(default_factory=dict)  # logical name -> model's name
    #: None: the default layout, or Whisper's for Hugging Face's ``input_features`` without lengths
    layout: EncoderLayoutConfig | None = None


class VocabularyConfig(_Section):
    """One label per line; special labels by label string or index (``None``: none)."""

    path: ConfigPath
    blank: LabelSpec | None = None
    sentence_begin: LabelSpec | None = None
    sentence_end: LabelSpec | None = None
    unknown: LabelSpec | None = None

    def load(self):
        """The :class:`~gpudecode.io.vocabulary.Vocabulary` this section names."""
        from gpudecode.io.vocabulary import Vocabulary

        return Vocabulary.load(self.path, blank=self.blank, sentence_begin=self.sentence_begin,
                               sentence_end=self.sentence_end, unknown=self.unknown)


class FrontEndConfig(_Section):
    """The front end for audio input: ``type`` ``log-mel`` (names match ``io.frontend.LogMelOptions``)
    or ``whisper`` (Whisper's log-mel, ``io.whisper_frontend``: only ``sample_rate_hz`` and
    ``num_mel_bins`` apply; 30 s, 3000 frames per recording)."""

    type: Literal["log-mel", "whisper"] = "log-mel"
    sample_rate_hz: PositiveInt = defaults.SAMPLE_RATE_HZ
    window_ms: PositiveFloat = defaults.WINDOW_MS
    hop_ms: PositiveFloat = defaults.HOP_MS
    fft_size: PositiveInt | None = defaults.FFT_SIZE
    num_mel_bins: PositiveInt = defaults.NUM_MEL_BINS
    low_freq_hz: Annotated[float, Field(ge=0)] = defaults.LOW_FREQ_HZ
    high_freq_hz: PositiveFloat | None = defaults.HIGH_FREQ_HZ
    log_floor: PositiveFloat = defaults.LOG_FLOOR
    window_type: Literal[defaults.WINDOW_TYPES] = defaults.WINDOW_TYPE
    preemphasis: Annotated[float, Field(ge=0, lt=1)] = defaults.PREEMPHASIS
    normalisation: Literal[defaults.NORMALISATIONS] = defaults.NORMALISATION
    stats_file: ConfigPath | None = None  # .npz with mean, std; for normalisation: global
    # Seconds between feature frames, for CTM times; None: hop_ms.
    frame_shift_ms: PositiveFloat | None = None

    @model_validator(mode="after")
    def _check(self) -> FrontEndConfig:
        from gpudecode.io.frontend import FrontEndError, LogMelOptions, mel_filterbank

        if self.normalisation == "global" and self.stats_file is None:
            raise _KeyedError(["stats_file"], "normalisation 'global' needs stats_file "
                              "(an .npz with 'mean' and 'std')")
        if self.normalisation != "global" and self.stats_file is not None:
            raise _KeyedError(["stats_file"], f"stats_file is only used with normalisation "
                              f"'global' (normalisation is {self.normalisation!r})")
        if self.type == "whisper":
            if self.normalisation != defaults.NORMALISATION or self.preemphasis != defaults.PREEMPHASIS:
                raise ValueError("the whisper front end has its own scaling: leave normalisation and "
                                 "preemphasis at their defaults")
            return self
        try:
            mel_filterbank(LogMelOptions.from_any(self))
        except FrontEndError as exc:
            raise ValueError(str(exc)) from None
        return self

    @property
    def frame_shift_s(self) -> float:
        return (self.frame_shift_ms if self.frame_shift_ms is not None else self.hop_ms) / 1000


class TransducerConfig(_Section):
    """The prediction and joint networks of a transducer (the encoder is ``models.encoder``).

    ``context_size``: None for a stateful prediction network (its states through
    ``state_manager``); k for a stateless one fed the last k labels."""

    prediction: ConfigPath
    joint: ConfigPath
    context_size: PositiveInt | None = None
    state_manager: StateManagerConfig = Field(default_factory=lambda: StateManagerConfig(type="lstm"))
    prediction_io_map: dict[str, str] = Field(default_factory=dict)
    joint_io_map: dict[str, str] = Field(default_factory=dict)
    joint_scores_kind: Literal["log-probs", "logits"] = "log-probs"


class ModelsConfig(_Section):
    encoder: EncoderConfig | None = None
    transducer: TransducerConfig | None = None
    vocabulary: VocabularyConfig
    front_end: FrontEndConfig = Field(default_factory=FrontEndConfig)


class StateManagerConfig(_Section):
    """Options of a scorer's state manager; validated by the state managers' own option type."""

    type: Literal[tuple(STATE_MANAGER_TYPES)] = defaults.STATE_MANAGER_TYPE
    max_history: NonNegativeInt | None = defaults.MAX_HISTORY
    always_include_first_token_state: bool = defaults.ALWAYS_INCLUDE_FIRST_TOKEN_STATE
    slots_per_chunk: PositiveInt = defaults.SLOTS_PER_CHUNK
    storage_dtype: Literal[defaults.STORAGE_DTYPES] = defaults.STORAGE_DTYPE
    state_compression: Literal[defaults.STATE_COMPRESSIONS] = defaults.STATE_COMPRESSION
    state_compression_bits: Literal[8, 16] = 8
    state_compression_scale: PositiveFloat | None = None
    cpu_in_place: bool = True
    dense_recurrent: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> StateManagerConfig:
        from gpudecode.backend import GpuUnavailableError
        from gpudecode.states.options import StateManagerConfigError

        try:
            self.to_options()
        except GpuUnavailableError as exc:
            raise _KeyedError(["type"], str(exc).removeprefix("state_manager.type: ")) from exc
        except StateManagerConfigError as exc:
            key, _, message = str(exc).partition(": ")
            path = key.split(".")[1:] if key.startswith("state_manager.") else []
            raise _KeyedError(path, message if path else str(exc)) from exc
        return self

    def to_options(self, device_id: int = 0):
        """The typed options the state managers take."""
        from gpudecode.states.options import StateManagerOptions

        return StateManagerOptions(device_id=device_id, **self.model_dump())


class ScorerConfig(_Section):
    """One label scorer. ``type``: a built-in type, a name registered with ``@register_scorer``
    (its module imported before the config is validated) or a ``module:Class`` import path.
    ``name`` (default: the type) keys the per-scorer scores in the outputs.

    ``base_dir`` (own scorers only; default: the config file's folder): where a ``module:Class``
    is imported from when the Python path does not find it (then the working directory), and
    what the relative paths among ``options`` that the class lists in ``path_options`` resolve
    against."""

    type: str
    name: str = ""
    scale: float = defaults.SCORER_SCALE
    model: ConfigPath | tuple[ConfigPath, ...] | dict[str, ConfigPath] | None = None
    state_manager: StateManagerConfig | None = None
    io_map: dict[str, str] = Field(default_factory=dict)
    scores_kind: Literal[defaults.SCORES_KINDS] = defaults.SCORES_KIND
    max_batch_size: PositiveInt | None = None
    cuda_graphs: bool | None = None  # None: runtime.cuda_graphs.enabled
    start_labels: tuple[LabelSpec, ...] = ()
    options: dict[str, Any] = Field(default_factory=dict)  # free, for custom scorers
    base_dir: ConfigFolder | None = None

    @field_validator("type")
    @classmethod
    def _check_type(cls, value: str) -> str:
        from gpudecode.scorers.registry import is_registered_scorer_type, user_registered_types

        if (value in defaults.BUILTIN_SCORER_TYPES or _SCORER_IMPORT_PATH.match(value)
                or is_registered_scorer_type(value)):
            return value
        names = [*defaults.BUILTIN_SCORER_TYPES, *user_registered_types()]
        close = difflib.get_close_matches(value, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"invalid choice {value!r}{hint}; valid choices: "
                         f"{', '.join(names)}, a name registered with @register_scorer (its module "
                         "imported first), or a custom scorer as 'module:Class'")

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: Any, info: ValidationInfo) -> Any:
        if isinstance(data, dict) and not data.get("name") and isinstance(data.get("type"), str):
            data = {**data, "name": data["type"]}
        base_dir = (info.context or {}).get("base_dir")
        if (isinstance(data, dict) and data.get("base_dir") is None and base_dir is not None
                and isinstance(data.get("type"), str) and data["type"] not in defaults.BUILTIN_SCORER_TYPES):
            data = {**data, "base_dir": str(base_dir)}
        return data

    @property
    def import_path(self) -> tuple[Path, ...]:
        """Where a ``module:Class`` type is looked for after the Python path: ``base_dir``, then the
        working directory."""
        return (*((Path(self.base_dir),) if self.base_dir is not None else ()), Path.cwd())


class SearchTuningConfig(_Section):
    """``search.tuning``: how the searches run, never what they find
    (:class:`gpudecode.search.tuning.SearchTuning`; ``null``: on CuPy only)."""

    lagged_stop_test: bool | None = None
    stop_test_lag: StrictPositiveInt = defaults.STOP_TEST_LAG
    stop_test_every: StrictPositiveInt = defaults.STOP_TEST_EVERY
    lagged_continuous_mask: bool | None = None
    fused_label_step: bool = True
    fused_ctc_frames: bool = True
    captured_ctc_frames: bool = True
    ctc_prefilter: bool = True
    fused_transducer_step: bool = True
    host_wait: Literal[defaults.HOST_WAIT_MODES] = defaults.HOST_WAIT
    host_wait_nap_s: PositiveFloat = defaults.HOST_WAIT_NAP_S
    host_wait_max_nap_s: PositiveFloat = defaults.HOST_WAIT_MAX_NAP_S
    compiled_cpu_loops: bool = True
    cpu_threads: StrictPositiveInt = defaults.CPU_THREADS

    @model_validator(mode="after")
    def _check(self) -> SearchTuningConfig:
        if self.host_wait == "nap" and self.host_wait_nap_s > self.host_wait_max_nap_s:
            raise _KeyedError(["host_wait_nap_s"], f"host_wait_nap_s ({self.host_wait_nap_s}) exceeds "
                              f"host_wait_max_nap_s ({self.host_wait_max_nap_s})")
        return self

    def to_options(self):
        """The :class:`gpudecode.search.tuning.SearchTuning` these keys describe."""
        from gpudecode.backend import HostWait
        from gpudecode.search.tuning import SearchTuning

        fields = self.model_dump()
        wait = HostWait(fields.pop("host_wait"), nap_s=fields.pop("host_wait_nap_s"),
                        max_nap_s=fields.pop("host_wait_max_nap_s"))
        return SearchTuning(host_wait=wait, **fields)


class SearchConfig(_Section):
    type: str = defaults.SEARCH_TYPE  # a registered search type (gpudecode.search.registry)
    beam_size: PositiveInt = defaults.BEAM_SIZE
    nbest: PositiveInt | None = defaults.NBEST
    score_threshold: PositiveFloat | None = defaults.SCORE_THRESHOLD
    #: ctc-prefix: per frame only labels of at least this log-prob (and the frame's best) take part
    token_min_logp: NonPositiveFloat | None = None
    length_norm_scale: Annotated[float, Field(ge=0)] = defaults.LENGTH_NORM_SCALE
    max_labels_per_input: PositiveFloat = defaults.MAX_LABELS_PER_INPUT
    max_labels: PositiveInt = defaults.MAX_LABELS
    batch_size: PositiveInt | None = None  # None: by device (defaults.SEARCH_BATCH_SIZE, _CUDA)
    #: padded input frames per search call (utterances x the longest); None: by device
    #: (defaults.SEARCH_BATCH_FRAMES, _CUDA)
    batch_frames: PositiveInt | None = None
    max_active_utterances: PositiveInt | None = defaults.MAX_ACTIVE_UTTERANCES
    admission_order: Literal[defaults.ADMISSION_ORDERS] = defaults.ADMISSION_ORDER
    max_cached_score_vectors: NonNegativeInt = defaults.MAX_CACHED_SCORE_VECTORS
    pre_beam_size: PositiveInt | None = defaults.PRE_BEAM_SIZE
    max_symbols_per_frame: PositiveInt = defaults.MAX_SYMBOLS_PER_FRAME
    recombination: Literal[defaults.RECOMBINATIONS] = defaults.RECOMBINATION
    # label-sync: the peers' search semantics (gpudecode.search.beam.LabelSyncOptions)
    min_length: NonNegativeInt = defaults.MIN_LENGTH
    finished: Literal[defaults.FINISHED_MODES] = defaults.FINISHED
    early_stopping: bool | Literal["never"] = defaults.EARLY_STOPPING
    length_counts: Literal[defaults.LENGTH_COUNTS] = defaults.LENGTH_COUNT
    options: dict[str, Any] = Field(default_factory=dict)  # free, for search types of plugins
    tuning: SearchTuningConfig = Field(default_factory=SearchTuningConfig)

    @field_validator("type")
    @classmethod
    def _check_type(cls, value: str) -> str:
        if is_search_type(value):  # built-in, or registered by a plugin imported before
            return value
        names = search_type_names()
        close = difflib.get_close_matches(value, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"invalid choice {value!r}{hint}; valid choices: {', '.join(names)}")

    @model_validator(mode="after")
    def _check(self) -> SearchConfig:
        if self.nbest is not None and self.nbest > self.beam_size:
            raise _KeyedError(["nbest"], f"nbest ({self.nbest}) exceeds beam_size "
                              f"({self.beam_size})")
        if self.pre_beam_size is not None and self.pre_beam_size < self.beam_size:
            raise _KeyedError(["pre_beam_size"], f"pre_beam_size ({self.pre_beam_size}) is "
                              f"smaller than beam_size ({self.beam_size})")
        if self.length_counts != defaults.LENGTH_COUNT and self.finished == "in-beam":
            raise _KeyedError(["length_counts"], f"length_counts {self.length_counts!r} needs "
                              "finished: separate or separate-genai")
        if self.finished == "separate-genai" and self.early_stopping == "never":
            raise _KeyedError(["early_stopping"], "early_stopping 'never' is Hugging Face's; GenAI "
                              "takes true or false")
        return self


class FeaturesConfig(_Section):
    path: ConfigPath
    format: Literal[defaults.FEATURE_FORMATS] = defaults.FEATURE_FORMAT
    num_features: PositiveInt | None = None  # expected F; None: from the first utterance


class IoConfig(_Section):
    features: FeaturesConfig | None = None
    output: ConfigPath = Field(default=Path(defaults.OUTPUT_FOLDER), validate_default=True)
    formats: tuple[Literal[defaults.OUTPUT_FORMAT_CHOICES], ...] = Field(
        default=defaults.OUTPUT_FORMATS, min_length=1)
    references: ConfigPath | None = None
    word_merging: Literal[defaults.WORD_MERGINGS] = defaults.WORD_MERGING
    on_bad_input: Literal[defaults.ON_BAD_INPUT_CHOICES] = defaults.ON_BAD_INPUT
    # per-utterance token prompts: "ID LABEL ..." per line; without features (and without
    # models.encoder) the prompts are the utterances
    prompts: ConfigPath | None = None
    prompts_format: Literal[defaults.PROMPT_FORMATS] = defaults.PROMPT_FORMAT

    @field_validator("formats")
    @classmethod
    def _unique(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(value)) != len(value):
            raise ValueError(f"repeated output format in {list(value)}")
        return value


class Config(_Section):
    """A whole experiment: ``runtime``, ``models``, ``scorers``, ``search``, ``io``."""

    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    models: ModelsConfig
    scorers: tuple[ScorerConfig, ...] = ()
    search: SearchConfig = Field(default_factory=SearchConfig)
    # Validated from {} (not built by a factory) so io.output resolves against the config folder.
    io: IoConfig = Field(default_factory=dict, validate_default=True)

    @model_validator(mode="after")
    def _check(self) -> Config:
        seen: dict[str, int] = {}
        for i, scorer in enumerate(self.scorers):
            if scorer.name in seen:
                raise _KeyedError(
                    ["scorers", i, "name"],
                    f"duplicate scorer name {scorer.name!r} (also scorers[{seen[scorer.name]}]);"
                    " give each scorer a distinct name")
            seen[scorer.name] = i
            if scorer.cuda_graphs and self.runtime.device != "cuda":
                raise _KeyedError(["scorers", i, "cuda_graphs"], "CUDA graphs need runtime.device cuda")
        return self

    @property
    def batch_size(self) -> int:
        """Utterances per search call: ``search.batch_size``, or where unset the device's default
        (``defaults.SEARCH_BATCH_SIZE`` on the CPU, ``SEARCH_BATCH_SIZE_CUDA`` on CUDA)."""
        if self.search.batch_size is not None:
            return self.search.batch_size
        return defaults.SEARCH_BATCH_SIZE_CUDA if self.runtime.device == "cuda" else defaults.SEARCH_BATCH_SIZE

    @property
    def batch_sizing(self) -> BatchSizing:
        """How the run cuts its utterances into search calls: :attr:`batch_size` utterances and
        ``search.batch_frames`` padded frames (unset: the device's default); on CUDA with both
        unset, a small first batch (``defaults.SEARCH_FIRST_BATCH_SIZE_CUDA``) for early results."""
        cuda = self.runtime.device == "cuda"
        frames = self.search.batch_frames
        if frames is None:
            frames = defaults.SEARCH_BATCH_FRAMES_CUDA if cuda else defaults.SEARCH_BATCH_FRAMES
        by_default = cuda and self.search.batch_size is None and self.search.batch_frames is None
        return BatchSizing(self.batch_size, frames,
                           defaults.SEARCH_FIRST_BATCH_SIZE_CUDA if by_default else None)


# --- errors: pydantic's error list -> one ConfigError naming key paths ---------------------

def _strip_annotation(ann: Any) -> Any:
    """Drop ``Annotated`` and ``None`` from an annotation; a union of several stays a list."""
    while typing.get_origin(ann) is Annotated:
        ann = typing.get_args(ann)[0]
    if typing.get_origin(ann) in (Union, types.UnionType):
        members = [_strip_annotation(a) for a in typing.get_args(ann) if a is not type(None)]
        return members[0] if len(members) == 1 else members
    return ann


def _is_model(ann: Any) -> bool:
    return isinstance(ann, type) and issubclass(ann, BaseModel)


def _pick_member(members: list, tag: str) -> Any:
    for member in members:
        origin = typing.get_origin(member)
        if _is_model(member) and tag == member.__name__:
            return member
        if origin in (tuple, list) and tag.startswith(("tuple", "list")):
            return member
        if origin is dict and tag.startswith("dict"):
            return member
    return None


def _walk_loc(loc: Sequence[str | int]) -> tuple[list[str | int], Any]:
    """The loc without pydantic's union tags, and the model class holding the last key."""
    ann: Any = Config
    out: list[str | int] = []
    parent: Any = None
    for part in loc:
        ann = _strip_annotation(ann)
        if isinstance(ann, list):  # a union: this part is pydantic's tag of the member
            ann = _pick_member(ann, str(part))
            continue
        parent = ann
        out.append(part)
        origin = typing.get_origin(ann)
        if _is_model(ann):
            field = ann.model_fields.get(part) if isinstance(part, str) else None
            ann = field.annotation if field is not None else None
        elif origin in (tuple, list):
            ann = typing.get_args(ann)[0]
        elif origin is dict:
            ann = typing.get_args(ann)[1]
        else:
            ann = None
    return out, parent


def _format_key_path(parts: Iterable[str | int]) -> str:
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _translate(exc: ValidationError) -> list[tuple[str, str]]:
    problems: dict[str, list[str]] = {}
    for err in exc.errors():
        loc = list(err["loc"])
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, _KeyedError):
            loc += list(cause.key_path)
        parts, parent = _walk_loc(loc)
        key = _format_key_path(parts) or "(top level)"
        kind = err["type"]
        if kind == "extra_forbidden":
            valid = list(parent.model_fields) if _is_model(parent) else []
            section = _format_key_path(parts[:-1]) or "the top level"
            close = difflib.get_close_matches(str(parts[-1]), valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            message = f"unknown key{hint}; valid keys in {section}: {', '.join(valid)}"
        elif kind == "missing":
            message = "required key is missing"
        elif kind == "literal_error":
            expected = err.get("ctx", {}).get("expected", "")
            choices = ", ".join(re.findall(r"'([^']*)'", expected)) or expected
            message = f"invalid choice {_describe(err['input'])}; valid choices: {choices}"
        elif kind in ("value_error", "assertion_error"):
            message = str(cause) if cause is not None else err["msg"]
        elif kind in ("path_type", "path_parsing"):
            message = f"expected a path (got {_describe(err['input'])})"
        elif kind in ("tuple_type", "list_type"):
            message = f"expected a list (got {_describe(err['input'])})"
        elif kind == "dict_type":
            message = f"expected a mapping (got {_describe(err['input'])})"
        elif kind in ("model_type", "model_attributes_type"):
            message = f"expected a section: a mapping of keys (got {_describe(err['input'])})"
        else:
            message = f"{err['msg'][:1].lower()}{err['msg'][1:]} (got {_describe(err['input'])})"
        if message not in problems.setdefault(key, []):
            problems[key].append(message)
    # A union reports every member's complaint; where one member got further (an error
    # deeper inside the value), keep only the deeper errors.
    deeper = {key for key in problems for other in problems
              if other != key and other.startswith((key + ".", key + "["))}
    return [(key, " or ".join(msgs)) for key, msgs in problems.items() if key not in deeper]


def _raise_config_error(problems: list[tuple[str, str]], source: str) -> typing.NoReturn:
    lines = [f"{source}: {key}: {message}" for key, message in problems]
    raise ConfigError("\n".join(lines), problems)


# --- loading -----------------------------------------------------------------------------------

def validate_config(data: Any, base_dir: str | Path = ".", *, source: str = "config") -> Config:
    """Validate a parsed YAML mapping; relative paths resolve against ``base_dir``."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        _raise_config_error([("(top level)", f"expected a mapping of sections, got "
                              f"{type(data).__name__}")], source)
    try:
        return Config.model_validate(data, context={"base_dir": Path(base_dir).absolute()})
    except ValidationError as exc:
        _raise_config_error(_translate(exc), source)


def _split_key(key: str) -> list[str]:
    key = re.sub(r"\[(\d+)\]", r".\1", key.strip())
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ValueError("empty key part")
    return parts


def _override_failure(override: str):
    def fail(problem: str) -> typing.NoReturn:
        raise ConfigError(f"override {override!r}: {problem}", [(override, problem)])

    return fail


def apply_overrides(data: dict, overrides: Iterable[str]) -> dict:
    """A deep copy of ``data`` with each ``a.b.c=value`` applied. ``value`` is parsed as YAML
    (``3`` is an int, ``[text, ctm]`` a list, ``null`` None); list elements are addressed by
    index (``scorers.0.scale=0.5`` or ``scorers[0].scale=0.5``); missing sections are created."""
    data = copy.deepcopy(data) if data is not None else {}
    for override in overrides:
        fail = _override_failure(override)
        key, sep, raw = override.partition("=")
        if not sep:
            fail("expected key.path=value")
        try:
            parts = _split_key(key)
            value = yaml.safe_load(raw)
        except ValueError:
            fail("the key has an empty part")
        except yaml.YAMLError as exc:
            fail(f"the value is not valid YAML: {exc}")
        node: Any = data
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            where = ".".join(parts[:depth]) or "the top level"
            if isinstance(node, list):
                if not part.isdigit():
                    fail(f"{where} is a list; expected an index, got {part!r}")
                index = int(part)
                if index > len(node) or (index == len(node) and not last):
                    fail(f"index {index} is out of range: {where} has {len(node)} entries")
                if last and index == len(node):
                    node.append(value)
                elif last:
                    node[index] = value
                else:
                    node = node[index]
            elif isinstance(node, dict):
                if last:
                    node[part] = value
                else:
                    if node.get(part) is None:
                        node[part] = [] if parts[depth + 1].isdigit() else {}
                    node = node[part]
            else:
                fail(f"{where} is {_describe(node)}, not a section or list")
    return data


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read config: {exc}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from None


def load_config(path: str | Path, overrides: Iterable[str] = (), *, settings: Iterable[str] = ()) -> Config:
    """Read, override and validate a YAML config (see the module docstring). ``settings``: more
    ``key=value`` pairs applied after ``overrides`` that errors do not call -o overrides (the
    command line's own options, such as ``--output``)."""
    path = Path(path)
    data = _read_yaml(path)
    if data is not None and not isinstance(data, dict):
        _raise_config_error([("(top level)", f"expected a mapping of sections, got "
                              f"{type(data).__name__}")], str(path))
    overrides = list(overrides)
    data = apply_overrides(data or {}, [*overrides, *settings])
    source = str(path) + (" (with -o overrides)" if overrides else "")
    return validate_config(data, path.absolute().parent, source=source)


def dump_resolved(config: Config, path: str | Path) -> Path:
    """Write the fully resolved config (every default filled in, absolute paths) as YAML;
    ``load_config`` reads it back to an equal ``Config``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
    path.write_text("# gpudecode: fully resolved config\n" + text, encoding="utf-8")
    return path


# Paths the run writes rather than reads.
_OUTPUT_KEYS = {"io.output", "runtime.dump_inputs"}


def _iter_paths(value: Any, parts: list[str | int]) -> Iterator[tuple[str, Path]]:
    if isinstance(value, Path):
        yield _format_key_path(parts), value
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            if name != "options":  # free-form scorer options are the scorer's business
                yield from _iter_paths(getattr(value, name), [*parts, name])
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _iter_paths(item, [*parts, i])
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _iter_paths(item, [*parts, key])


def check_paths(config: Config, *, source: str = "config") -> None:
    """Raise ``ConfigError`` listing every input path of ``config`` that does not exist
    (model files, vocabulary, statistics, features, references; not the output folder)."""
    problems = [(key, f"does not exist: {path}") for key, path in _iter_paths(config, [])
                if key not in _OUTPUT_KEYS and not path.exists()]
    if problems:
        _raise_config_error(problems, source)
