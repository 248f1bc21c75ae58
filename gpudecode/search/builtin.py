"""The built-in search types (:mod:`gpudecode.search.registry`): how each makes its options from
the config's ``search`` section and decodes a batch of encoder outputs.

A new built-in type is its search module plus one :func:`register_search` here (and its name in
``registry.BUILTIN_SEARCH_TYPES``).
"""

from __future__ import annotations

from gpudecode.search.ctc import CtcPrefixOptions, ctc_greedy_search, ctc_prefix_search
from gpudecode.search.label_sync import LabelSyncOptions, label_sync_search
from gpudecode.search.positions import check_max_labels
from gpudecode.search.registry import SearchSetup, SearchType, register_search
from gpudecode.search.transducer import TransducerOptions, transducer_greedy_search, transducer_search


def _label_sync_options(setup: SearchSetup) -> LabelSyncOptions:
    search = setup.config
    check_max_labels(setup.scorers, search.max_labels)
    return LabelSyncOptions(
        beam_size=search.beam_size, sentence_end=setup.sentence_end,
        length_norm_scale=search.length_norm_scale, score_threshold=search.score_threshold,
        max_labels_per_input=search.max_labels_per_input, max_labels=search.max_labels,
        nbest=search.nbest, pre_beam_size=search.pre_beam_size, min_length=search.min_length,
        finished=search.finished, early_stopping=search.early_stopping, length_counts=search.length_counts,
    )


def _label_sync(setup: SearchSetup, batch):
    return label_sync_search(setup.scorers, batch, setup.options, xp=setup.xp,
                             max_active_utterances=setup.config.max_active_utterances,
                             admission_order=setup.config.admission_order, **setup.run_settings())


def _ctc_prefix_options(setup: SearchSetup) -> CtcPrefixOptions:
    search = setup.config
    return CtcPrefixOptions(
        beam_size=search.beam_size, blank=setup.blank, score_threshold=search.score_threshold,
        sentence_end=setup.sentence_end if setup.scorers else None,
        max_cached_score_vectors=search.max_cached_score_vectors, nbest=search.nbest,
        token_min_logp=search.token_min_logp,
    )


def _ctc_prefix(setup: SearchSetup, batch):
    return ctc_prefix_search(batch.inputs["encoder-states"], batch.input_lengths, setup.options, setup.scorers,
                             xp=setup.xp, ids=list(batch.ids), **setup.run_settings())


def _ctc_greedy(setup: SearchSetup, batch):
    return ctc_greedy_search(batch.inputs["encoder-states"], batch.input_lengths, blank=setup.blank, xp=setup.xp,
                             ids=list(batch.ids), **setup.run_settings())


def _transducer_options(setup: SearchSetup) -> TransducerOptions:
    search = setup.config
    return TransducerOptions(
        beam_size=search.beam_size, blank=setup.blank, max_symbols_per_frame=search.max_symbols_per_frame,
        recombination=search.recombination, score_threshold=search.score_threshold,
        sentence_end=setup.sentence_end if setup.scorers else None,
        max_cached_score_vectors=search.max_cached_score_vectors, nbest=search.nbest,
    )


def _transducer(setup: SearchSetup, batch):
    return transducer_search(batch.inputs["encoder-states"], batch.input_lengths, setup.prediction, setup.joint,
                             setup.options, setup.scorers, xp=setup.xp, ids=list(batch.ids), **setup.run_settings())


def _transducer_greedy(setup: SearchSetup, batch):
    return transducer_greedy_search(batch.inputs["encoder-states"], batch.input_lengths, setup.prediction,
                                    setup.joint, blank=setup.blank,
                                    max_symbols_per_frame=setup.config.max_symbols_per_frame, xp=setup.xp,
                                    ids=list(batch.ids), **setup.run_settings())


_CTC_ENCODER = "the encoder that outputs frame log-probs"

register_search(SearchType(
    name="label-sync", title="the label-synchronous search", decode=_label_sync,
    make_options=_label_sync_options, options_class=LabelSyncOptions, scorers="required",
    labels=("sentence_end",)))
register_search(SearchType(
    name="ctc-prefix", title="CTC decoding", decode=_ctc_prefix, make_options=_ctc_prefix_options,
    options_class=CtcPrefixOptions, needs_encoder=True, encoder_role=_CTC_ENCODER, labels=("blank",)))
register_search(SearchType(
    name="ctc-greedy", title="greedy CTC decoding", decode=_ctc_greedy, make_options=_ctc_prefix_options,
    options_class=CtcPrefixOptions, scorers="forbidden", alternative="ctc-prefix", needs_encoder=True,
    encoder_role=_CTC_ENCODER, labels=("blank",)))
register_search(SearchType(
    name="transducer", title="transducer decoding", decode=_transducer, make_options=_transducer_options,
    options_class=TransducerOptions, needs_encoder=True, needs_transducer=True, labels=("blank",)))
register_search(SearchType(
    name="transducer-greedy", title="greedy transducer decoding", decode=_transducer_greedy,
    make_options=_transducer_options, options_class=TransducerOptions, scorers="forbidden",
    alternative="transducer", needs_encoder=True, needs_transducer=True, labels=("blank",)))
