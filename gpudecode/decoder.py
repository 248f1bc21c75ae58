"""The Python API: an encoder, label scorers and a search built from one config.

    from gpudecode import Decoder
    decoder = Decoder.from_config("configs/example.yaml")
    nbest = decoder.decode({"utt1": features_1, "utt2": features_2})   # id -> [Hypothesis, ...]
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from gpudecode.backend import array_module, to_host
from gpudecode.config import Config, ConfigError, ScorerConfig, load_config, validate_config
from gpudecode.io.features import bucket_by_length, pad_features as _pad  # _pad: the one padding rule
from gpudecode.hypothesis import Hypothesis
from gpudecode.scorers import UtteranceBatch, create_scorer
from gpudecode.scorers.registry import ScorerTypeError, scorer_class
from gpudecode.search.registry import SearchSetup, SearchTypeError, search_type
from gpudecode.session import EncoderLayout, ModelError, ModelSpec, OnnxSession, SessionOptions, discover_encoder
from gpudecode.session.graphs import GraphOptions
from gpudecode.session.pairs import check_cross_inputs, check_vocab_sizes, last_dim
from gpudecode.states.options import StateManagerOptions

ONNX_SCORERS = ("onnx-decoder", "recurrent-lm")
PROMPT_OPTIONS = ("initial_prompt_labels", "suffix_prompt_labels")


class Decoder:
    """Decodes feature arrays with the models, scorers and search of a :class:`Config`.

    The search is the registered type ``config.search.type`` (:mod:`gpudecode.search.registry`):
    the decoder builds what the type asks for and hands it over as :attr:`search_setup`. It runs
    with ``config.search.tuning`` (:class:`gpudecode.search.tuning.SearchTuning`, or ``tuning``
    when given) and adds its timings and counts to ``stats`` (a
    :class:`gpudecode.search.stats.SearchStats`; None: nothing measured). With ``timings`` (an
    object with ``encoder_s`` and ``search_s``, e.g. :class:`gpudecode.job.RunTimings`),
    :meth:`decode_batch` adds the host seconds of the encoder and of the search to it.
    """

    def __init__(self, config: Config, *, tuning=None, stats=None, timings=None):
        self.config = config
        self.timings = timings
        runtime = config.runtime
        self.xp = array_module(runtime.device)
        if runtime.device == "cuda" and runtime.cupy_pool_limit_bytes is not None:
            with self.xp.cuda.Device(runtime.device_id):
                self.xp.get_default_memory_pool().set_limit(size=runtime.cupy_pool_limit_bytes)
        self.session_options = SessionOptions(
            device=runtime.device, device_id=runtime.device_id, use_tf32=runtime.tf32, gqa_xqa=runtime.gqa_xqa,
            arena_limit_bytes=runtime.ort_arena_limit_bytes,
            cudnn_conv_algo_search=runtime.cudnn_conv_algo_search, dump_inputs=runtime.dump_inputs,
        )
        self.vocabulary = config.models.vocabulary.load()
        search = config.search
        try:
            self.search_type = search_type(search.type)
            self.search_type.check(config)
        except SearchTypeError as exc:
            raise ConfigError(str(exc)) from None
        needs = self.search_type.labels
        self.sentence_end = (self._special("sentence_end") if "sentence_end" in needs
                             else self.vocabulary.sentence_end_index)
        self.encoder = None
        if config.models.encoder is not None:
            self.encoder = OnnxSession(config.models.encoder.path, self.session_options)
            layout = config.models.encoder.layout
            self.encoder_spec = discover_encoder(
                self.encoder.tensors, io_map=config.models.encoder.io_map,
                layout=None if layout is None else EncoderLayout(**layout.model_dump()))
        self.scorers = [(s.name, self._build_named(i, s), s.scale) for i, s in enumerate(config.scorers)]
        self.blank = self._special("blank") if "blank" in needs else None
        self.prediction = self.joint = None
        if self.search_type.needs_transducer:
            self.prediction, self.joint = self._build_transducer(config.models.transducer)
        self._check_model_pairs()
        setup = SearchSetup(config=search, scorers=tuple(self.scorers), xp=self.xp, blank=self.blank,
                            sentence_end=self.sentence_end, prediction=self.prediction, joint=self.joint,
                            tuning=search.tuning.to_options() if tuning is None else tuning, stats=stats)
        make_options = self.search_type.make_options
        self.search_options = make_options(setup) if make_options is not None else None
        #: What the search type decodes with (its options included).
        self.search_setup = dataclasses.replace(setup, options=self.search_options)

    @property
    def encoder_num_features(self) -> int | None:
        """F the encoder declares (None without an encoder or for a dynamic F)."""
        return self.encoder_spec.num_features if self.encoder is not None else None

    @classmethod
    def from_config(cls, config: Config | Mapping | str | Path, overrides: Sequence[str] = (), *, tuning=None,
                    stats=None) -> Decoder:
        """From a :class:`Config`, a dict (paths relative to the working directory) or a YAML file
        (``tuning``, ``stats``: as for :class:`Decoder`)."""
        if isinstance(config, (str, Path)):
            config = load_config(config, overrides)
        elif isinstance(config, Mapping):
            config = validate_config(dict(config))
        return cls(config, tuning=tuning, stats=stats)

    def _special(self, role: str) -> int:
        index = getattr(self.vocabulary, f"{role}_index")
        if index is None:
            raise ConfigError(f"models.vocabulary.{role}: the label-synchronous search needs a {role.replace('_', '-')} label")
        return int(index)

    def _build_transducer(self, models):
        """(prediction network, joint network) of ``models.transducer``."""
        from gpudecode.scorers.transducer import JointNetwork, StatefulPredictionNetwork, StatelessPredictionNetwork

        graphs = self.config.runtime.cuda_graphs.to_options(device=self.config.runtime.device)
        if models.context_size is None:
            prediction = StatefulPredictionNetwork(
                model=models.prediction, blank=self.blank, session_options=self.session_options,
                state_manager=models.state_manager.to_options(self.config.runtime.device_id),
                io_map=models.prediction_io_map, graphs=graphs if graphs.auto else GraphOptions())
        else:
            prediction = StatelessPredictionNetwork(
                model=models.prediction, blank=self.blank, context_size=models.context_size,
                session_options=self.session_options, io_map=models.prediction_io_map)
        joint = JointNetwork(model=models.joint, session_options=self.session_options, io_map=models.joint_io_map,
                             scores_kind=models.joint_scores_kind, graphs=graphs if graphs.auto else GraphOptions())
        return prediction, joint

    @property
    def _fixed_frames(self) -> bool:
        """The encoder gives every utterance the same frames (no lengths): per-utterance inputs of
        the scorers need no mask."""
        return self.encoder is not None and not self.encoder_spec.has_lengths

    def _graphs(self, scorer):
        """The CUDA-graph options of one scorer: the runtime's, switched by the scorer's own key."""
        return self.config.runtime.cuda_graphs.to_options(scorer.cuda_graphs, device=self.config.runtime.device)

    def _build_named(self, index: int, scorer: ScorerConfig):
        """:meth:`_build_scorer`; a model that does not fit is a ``ModelError`` naming the scorer."""
        try:
            return self._build_scorer(index, scorer)
        except ScorerTypeError as exc:  # options the class does not take
            raise ConfigError(f"scorers[{index}].options: {exc}") from None
        except ModelError as exc:
            key = f"scorers[{index}] {scorer.name!r}"
            if str(exc).startswith(key) or str(exc).startswith(f"scorer {scorer.name!r}"):
                raise
            raise ModelError(f"{key}: {exc}") from exc

    def _check_model_pairs(self) -> None:
        """Models loaded together must fit each other (:mod:`gpudecode.session.pairs`): the encoder's
        outputs against each attention decoder's per-utterance inputs, and the label counts of the
        encoder's frame scores (CTC), the ONNX scorers and the transducer's joint network against
        the vocabulary. Each failure is a ``ModelError`` naming both models."""
        config, encoder = self.config, self.encoder
        sizes: list[tuple[str, int | None]] = []
        search = self.search_type
        if encoder is not None:
            path = config.models.encoder.path
            if search.needs_encoder and not search.needs_transducer and "blank" in search.labels:
                main = self.encoder_spec.names["encoder-states"]  # frame log-probs of a CTC search
                sizes.append((f"models.encoder ({path}, output '{main}')", last_dim(encoder.tensors.output(main))))
        for i, (scorer_config, (name, scorer, _)) in enumerate(zip(config.scorers, self.scorers)):
            key = f"scorers[{i}] {name!r}"
            spec = getattr(scorer, "spec", None)
            if scorer_config.type == "ctc-prefix" and encoder is not None:
                output = scorer_config.io_map.get("log-probs", "log-probs")
                sizes.append((f"{key} (the CTC head '{output}' of {config.models.encoder.path})",
                              last_dim(encoder.tensors.output(output))))
            if isinstance(spec, ModelSpec):
                sizes.append((f"{key} ({spec.source})", spec.vocab_size))
                if encoder is not None and scorer_config.type == "onnx-decoder":
                    check_cross_inputs(spec, self.encoder_spec, who=key)
        if self.joint is not None:
            sizes.append((f"models.transducer.joint ({config.models.transducer.joint})",
                          getattr(self.joint, "vocab_size", None)))
        check_vocab_sizes(sizes, (str(config.models.vocabulary.path), len(self.vocabulary)))

    def _build_scorer(self, index: int, scorer: ScorerConfig):
        key = f"scorers[{index}]"
        if scorer.type in ONNX_SCORERS:
            if scorer.model is None or not isinstance(scorer.model, (str, Path)):
                raise ConfigError(f"{key}.model: {scorer.type} needs the path of one ONNX step model")
            start = scorer.start_labels or (self._special("sentence_begin"),)
            state_manager = (scorer.state_manager.to_options(self.config.runtime.device_id)
                             if scorer.state_manager else StateManagerOptions(device_id=self.config.runtime.device_id))
            return create_scorer(
                scorer.type, name=scorer.name, model=scorer.model, vocab_size=len(self.vocabulary),
                start_labels=[self.vocabulary.resolve(label, f"{key}.start_labels") for label in start],
                state_manager=state_manager, session_options=self.session_options, io_map=scorer.io_map,
                scores_kind=scorer.scores_kind, max_batch_size=scorer.max_batch_size, graphs=self._graphs(scorer),
                fixed_frames=self._fixed_frames,
            )
        if scorer.type == "prefix-lm":
            models = (scorer.model if isinstance(scorer.model, dict)
                      else {"step": scorer.model} if isinstance(scorer.model, (str, Path)) else {})
            if set(models) not in ({"step", "prefill"}, {"step"}):
                raise ConfigError(f"{key}.model: prefix-lm needs two ONNX models, as {{step: PATH, prefill: PATH}}, "
                                  "or one step model that is its own prefill, as PATH (a GenAI model folder too)")
            unknown = set(scorer.options) - set(PROMPT_OPTIONS)
            if unknown:
                raise ConfigError(f"{key}.options: unknown {sorted(unknown)}; valid: {', '.join(PROMPT_OPTIONS)}")
            prompts = {name: [self.vocabulary.resolve(label, f"{key}.options.{name}") for label in scorer.options.get(name, ())]
                       for name in PROMPT_OPTIONS}
            state_manager = (scorer.state_manager.to_options(self.config.runtime.device_id)
                             if scorer.state_manager else StateManagerOptions(device_id=self.config.runtime.device_id))
            return create_scorer(
                "prefix-lm", name=scorer.name, model=models["step"], prefill_model=models.get("prefill"), vocab_size=len(self.vocabulary),
                state_manager=state_manager, session_options=self.session_options, io_map=scorer.io_map,
                scores_kind=scorer.scores_kind, max_batch_size=scorer.max_batch_size, graphs=self._graphs(scorer),
                fixed_frames=self._fixed_frames, **prompts,
            )
        if scorer.type == "ctc-prefix":  # joint CTC/attention: the encoder also outputs frame log-probs
            return create_scorer("ctc-prefix", name=scorer.name, vocab_size=len(self.vocabulary), sentence_end=self._special("sentence_end"),
                                 blank=self._special("blank"), input_name=scorer.io_map.get("log-probs", "log-probs"))
        if scorer.type == "suppress-tokens":  # labels by name or index
            unknown = set(scorer.options) - {"tokens", "begin_tokens"}
            if unknown:
                raise ConfigError(f"{key}.options: unknown {sorted(unknown)}; valid: tokens, begin_tokens")
            labels = {name: [self.vocabulary.resolve(label, f"{key}.options.{name}") for label in scorer.options.get(name, ())]
                      for name in ("tokens", "begin_tokens")}
            return create_scorer("suppress-tokens", name=scorer.name, vocab_size=len(self.vocabulary), **labels)
        if scorer.type == "length-reward":
            return create_scorer("length-reward", name=scorer.name, vocab_size=len(self.vocabulary), sentence_end=self.sentence_end,
                                 **scorer.options)
        return self._build_own_scorer(key, scorer)

    def _build_own_scorer(self, key: str, scorer: ScorerConfig):
        """A registered or ``module:Class`` scorer: imported from the config's folder where the Python
        path does not find it, its ``path_options`` resolved against that folder, its ``vocab_size``
        checked against the vocabulary."""
        try:
            cls = scorer_class(scorer.type, scorer.import_path)
        except ScorerTypeError as exc:
            raise ConfigError(f"{key}.type: {exc}") from None
        options = dict(scorer.options)
        for name in getattr(cls, "path_options", ()):
            value = options.get(name)
            if isinstance(value, (str, Path)) and scorer.base_dir is not None:
                options[name] = str(Path(scorer.base_dir) / Path(value).expanduser())
        return create_scorer(scorer.type, search_path=scorer.import_path, name=scorer.name,
                             expected_vocab_size=len(self.vocabulary), **options)

    def encode(self, ids: Sequence[str], features: Sequence[np.ndarray] | None,
               prompts: Sequence[Sequence[int]] | None = None, *,
               padded: np.ndarray | None = None) -> UtteranceBatch:
        """Runs the encoder once over the padded batch; its outputs become per-utterance inputs,
        each with its sizes. ``prompts`` (label indices per utterance) become the ``prompt`` input
        [U, P] with their own sizes. Without features (a model without an encoder) the utterances
        are their prompts, each decoded up to ``search.max_labels`` labels.

        ``padded``: ``features`` already padded by :func:`~gpudecode.io.features.pad_features`
        ([U, T_max, F] float32, e.g. a :class:`~gpudecode.io.features.PaddedBatch`'s, padded where
        it was read), taken instead of padding them here; one of another shape, dtype or layout
        is refused (ValueError)."""
        if features is None and self.encoder is not None:
            raise ConfigError("models.encoder: the encoder needs features; give features with the prompts")
        if features is None and padded is not None:
            raise ValueError("padded features without features")
        prompt_inputs, prompt_sizes = self._prompt_inputs(ids, prompts)
        if features is None:
            if prompts is None:
                raise ValueError("nothing to decode: give features, or prompts for a model without an encoder")
            return UtteranceBatch(ids=ids, input_lengths=self._generation_lengths(len(ids)),
                                  inputs=prompt_inputs, sizes=prompt_sizes)
        if len(features) != len(ids):
            raise ValueError(f"{len(ids)} utterance ids but {len(features)} feature arrays")
        lengths = np.array([f.shape[0] for f in features], dtype=np.int32)
        if self.encoder is None:
            inputs = {"encoder-states": self.xp.asarray(_padded(features, lengths, padded))}
            sizes = lengths.astype(np.int64)
        else:
            spec = self.encoder_spec
            names, layout = spec.names, spec.layout
            if layout.fixed_frames is not None and (lengths != layout.fixed_frames).any():
                bad = int(np.argmax(lengths != layout.fixed_frames))
                raise ValueError(f"utterance {ids[bad]!r}: {int(lengths[bad])} feature frames; the encoder takes "
                                 f"exactly {layout.fixed_frames} (models.encoder.layout.fixed_frames; the whisper "
                                 "front end gives 3000)")
            padded = _padded(features, lengths, padded)
            feeds = {names["features"]: np.ascontiguousarray(padded.transpose(0, 2, 1))
                     if layout.channels_first else padded}
            if spec.has_lengths:
                feeds[names["features-size"]] = lengths.astype(self.encoder.tensors.input(names["features-size"]).dtype)
            outputs = self.encoder.run(feeds)
            if spec.has_lengths:
                sizes = to_host(outputs.pop(names["encoder-states-size"])).astype(np.int64)
            else:  # every utterance's states are the whole output: all frames attended to
                sizes = np.full(len(ids), outputs[names["encoder-states"]].shape[1], np.int64)
            inputs = {k: self.xp.asarray(v) for k, v in outputs.items()}
            if names["encoder-states"] != "encoder-states":
                inputs["encoder-states"] = inputs.pop(names["encoder-states"])
        return UtteranceBatch(ids=ids, input_lengths=sizes, inputs={**inputs, **prompt_inputs},
                              sizes={**{k: sizes for k in inputs}, **prompt_sizes})

    def _prompt_inputs(self, ids: Sequence[str], prompts):
        """({"prompt": [U, P] int64 on xp}, {"prompt": [U] sizes}), or two empty dicts."""
        if prompts is None:
            return {}, {}
        if len(prompts) != len(ids):
            raise ValueError(f"{len(ids)} utterance ids but {len(prompts)} prompts")
        if not self.takes_prompts:
            raise ConfigError(
                "scorers: the utterances bring token prompts, but no scorer reads them (a prefix-lm "
                "does: its prefill model takes 'input_ids' or 'prompt', or its step model is its own prefill)")
        rows = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]
        vocab = len(self.vocabulary)
        for utt, row in zip(ids, rows):
            if row.size and (row.min() < 0 or row.max() >= vocab):
                bad = int(row[(row < 0) | (row >= vocab)][0])
                raise ValueError(f"utterance {utt!r}: prompt label {bad} is out of range (0..{vocab - 1})")
        sizes = np.array([r.size for r in rows], dtype=np.int64)
        table = np.zeros((len(rows), int(sizes.max(initial=0))), dtype=np.int64)
        for u, row in enumerate(rows):  # once per utterance at admission
            table[u, :row.size] = row
        return {"prompt": self.xp.asarray(table)}, {"prompt": sizes}

    @property
    def takes_prompts(self) -> bool:
        """Whether a scorer reads the utterances' token prompts."""
        return any(getattr(scorer, "takes_prompts", False) for _, scorer, _ in self.scorers)

    def _generation_lengths(self, num_utts: int) -> np.ndarray:
        """[U] input lengths of utterances without an encoder: their label limit is ``search.max_labels``."""
        search = self.config.search
        per_input = getattr(search, "max_labels_per_input", None) or 1.0
        return np.full(num_utts, int(np.ceil(search.max_labels / per_input)), dtype=np.int64)

    @property
    def subsampling(self) -> int:
        """Input frames per encoder frame (1 without an encoder), from a probe run of the encoder."""
        if self.encoder is None:
            return 1
        if not hasattr(self, "_subsampling"):
            self._subsampling = _probe_subsampling(self.encoder, self.encoder_spec)
        return self._subsampling

    def decode_batch(self, ids: Sequence[str], features: Sequence[np.ndarray] | None,
                     prompts: Sequence[Sequence[int]] | None = None, *,
                     padded: np.ndarray | None = None) -> list[list[Hypothesis]]:
        """N-best lists of one batch of utterances decoded together (``prompts``: label indices per
        utterance, or None; ``features`` None for a model without an encoder; ``padded``: the
        features already padded, see :meth:`encode`).

        For time-synchronous searches, ``Hypothesis.frames`` are encoder frames (see :attr:`subsampling`).
        """
        if self.timings is None:
            return self.search_type.decode(self.search_setup, self.encode(ids, features, prompts, padded=padded))
        start = time.perf_counter()
        batch = self.encode(ids, features, prompts, padded=padded)
        encoded = time.perf_counter()
        try:
            return self.search_type.decode(self.search_setup, batch)
        finally:
            self.timings.encoder_s += encoded - start
            self.timings.search_s += time.perf_counter() - encoded

    def decode(self, features: Mapping[str, np.ndarray] | Sequence[np.ndarray] | None = None, *,
               prompts: Mapping[str, Sequence[int]] | Sequence[Sequence[int]] | None = None
               ) -> dict[str, list[Hypothesis]]:
        """N-best lists by utterance id (``features``: id -> [T, F] array, or a list: ids "0", "1", ...).

        ``prompts``: each utterance's token prompt (label indices), by the same ids (a dict) or in
        the same order (a list); a prefix-lm scorer prompts its model with them. Without
        ``features`` (a model without an encoder) the prompts are the utterances, each continued
        up to ``search.max_labels`` labels.

        Utterances are decoded in batches as ``gpudecode decode`` cuts them (``Config.batch_sizing``), longest first.
        """
        if features is None and prompts is None:
            raise ValueError("nothing to decode: give features, or prompts for a model without an encoder")
        if features is not None and not isinstance(features, Mapping):
            features = {str(i): f for i, f in enumerate(features)}
        if prompts is not None and not isinstance(prompts, Mapping):
            prompts = {str(i): p for i, p in enumerate(prompts)}
        if features is not None and prompts is not None and set(prompts) != set(features):
            missing = sorted(set(features) - set(prompts))
            extra = sorted(set(prompts) - set(features))
            raise ValueError(f"prompts and features differ in their ids: no prompt for {missing[:5]}, "
                             f"no features for {extra[:5]}")
        keys = list(features if features is not None else prompts)
        lengths = [(k, features[k].shape[0] if features is not None else len(prompts[k])) for k in keys]
        results = {}
        for ids in bucket_by_length(lengths, self.config.batch_sizing):
            batch_features = None if features is None else [np.asarray(features[i], np.float32) for i in ids]
            if prompts is None:
                nbests = self.decode_batch(ids, batch_features)
            else:
                nbests = self.decode_batch(ids, batch_features, [prompts[i] for i in ids])
            for utt, nbest in zip(ids, nbests):
                results[utt] = nbest
        return {k: results[k] for k in keys}

    def close(self) -> None:
        for _, scorer, _ in self.scorers:
            getattr(scorer, "close", lambda: None)()


def encoder_subsampling(config: Config) -> int:
    """Input frames per encoder frame of ``config``'s encoder (1 without one), probed on the CPU.

    For CTM times where no :class:`Decoder` is at hand (e.g. the driver of a Ray run)."""
    if config.models.encoder is None:
        return 1
    session = OnnxSession(config.models.encoder.path)
    layout = config.models.encoder.layout
    return _probe_subsampling(session, discover_encoder(
        session.tensors, io_map=config.models.encoder.io_map,
        layout=None if layout is None else EncoderLayout(**layout.model_dump())))


def _probe_subsampling(session: OnnxSession, spec, frames: int = 96) -> int:
    names = spec.names
    if not spec.has_lengths:  # a fixed-length encoder: its fixed frames over its output frames
        fixed = spec.layout.fixed_frames
        shape = (1, spec.num_features or 1, fixed) if spec.layout.channels_first else (1, fixed, spec.num_features or 1)
        out = session.run({names["features"]: np.zeros(shape, np.float32)}, [names["encoder-states"]])
        return max(1, round(fixed / max(int(out[names["encoder-states"]].shape[1]), 1)))
    features = np.zeros((1, frames, spec.num_features or 1), np.float32)
    size_dtype = session.tensors.input(names["features-size"]).dtype
    out = session.run({names["features"]: features, names["features-size"]: np.array([frames], size_dtype)},
                      [names["encoder-states-size"]])
    return max(1, round(frames / max(int(to_host(out[names["encoder-states-size"]])[0]), 1)))


def _padded(features: Sequence[np.ndarray], lengths: np.ndarray, padded: np.ndarray | None) -> np.ndarray:
    """``features`` padded (:func:`_pad`, the one padding rule), or ``padded`` when it has their
    shape [U, T_max, F] as float32 C-contiguous host memory (else ValueError: never another array)."""
    if padded is None:
        return _pad(features)
    want = (len(features), int(lengths.max()), int(features[0].shape[1]))
    if not isinstance(padded, np.ndarray) or padded.shape != want or padded.dtype != np.float32 \
            or not padded.flags.c_contiguous:
        got = (f"{type(padded).__name__} {getattr(padded, 'shape', '?')} {getattr(padded, 'dtype', '?')}"
               + ("" if not isinstance(padded, np.ndarray) or padded.flags.c_contiguous else " not C-contiguous"))
        raise ValueError(f"padded features: {got}; the batch's features pad to {want} float32 "
                         "(utterances, longest frames, features; C-contiguous)")
    return padded
