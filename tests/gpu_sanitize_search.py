"""Exercises the search kernels (kernels/top_k.cu, ctc_frame.cu, transducer_step.cu, label_step.cu
in the beam and with separate finished lists, score_maxima.cu, ctc_prefix_score.cu, hf_inputs.cu, log_softmax.cu;
ctc_frame.cu with and without label scorers, its scored frames replayed as CUDA graphs) for compute-sanitizer, with CuPy's memory pool disabled. Run on the GPU machine::

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 tests/gpu_sanitize_search.py
    compute-sanitizer --tool initcheck --error-exitcode 1 python3 tests/gpu_sanitize_search.py

Every result is also compared with the numpy path; a mismatch exits with status 2.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cupy  # noqa: E402
import numpy as np  # noqa: E402

cupy.cuda.set_allocator(None)
cupy.cuda.set_pinned_memory_allocator(None)

from gpudecode.bench.ctc import random_log_probs  # noqa: E402
from gpudecode.search import CtcPrefixOptions, TransducerOptions, ctc_prefix_search, transducer_search  # noqa: E402
from gpudecode.search.topk import top_k_indices  # noqa: E402


def main() -> int:
    rng = np.random.default_rng(0)
    for rows, cols, k in ((3, 7, 1), (5, 300, 8), (2, 5000, 32), (3, 4097, 8), (2, 80_000, 13), (4, 40, 40)):
        keys = rng.standard_normal((rows, cols)).astype(np.float32)
        keys[:, ::5] = keys[:, :1]  # ties
        if not np.array_equal(top_k_indices(cupy.asarray(keys), k).get(), top_k_indices(keys, k)):
            print(f"MISMATCH: top-k {rows}x{cols} k={k}", file=sys.stderr)
            return 2
    log_probs = random_log_probs(np, 6, 30, 12, seed=1, sharpness=2.0, blank_bias=1.5)
    lengths = np.array([30, 17, 1, 0, 29, 8])
    for options in (CtcPrefixOptions(beam_size=4), CtcPrefixOptions(beam_size=32, score_threshold=5.0),
                    CtcPrefixOptions(beam_size=6, hash_modulus=5, blank_skip_threshold_logp=-0.1),
                    CtcPrefixOptions(beam_size=3, hash_modulus=5, score_threshold=2.0,
                                     blank_skip_threshold_logp=-0.1)):  # beams 4 and 3: label prefilter
        expected = ctc_prefix_search(log_probs, lengths, options)
        got = ctc_prefix_search(cupy.asarray(log_probs), lengths, options, xp=cupy)
        if [[h.labels for h in n] for n in got] != [[h.labels for h in n] for n in expected]:
            print(f"MISMATCH: CTC prefix search {options}", file=sys.stderr)
            return 2
    from tests.test_transducer_search import make_models, random_encoder_states

    models = make_models(3, 5, sharpness=2.0)
    states = random_encoder_states(3, 3, 7)
    lengths = np.array([7, 4, 0])
    for options in (TransducerOptions(beam_size=4, max_symbols_per_frame=2),
                    TransducerOptions(beam_size=12, hash_modulus=3, score_threshold=3.0)):
        expected = transducer_search(states, lengths, models.prediction(), models.joint(), options)
        got = transducer_search(cupy.asarray(states), lengths, models.prediction("cuda"), models.joint("cuda"),
                                options, xp=cupy)
        if [[h.labels for h in n] for n in got] != [[h.labels for h in n] for n in expected]:
            print(f"MISMATCH: transducer search {options}", file=sys.stderr)
            return 2
    from gpudecode.search.label_sync import LabelSyncOptions
    from tests.test_label_step import both_selections

    for beam, vocab, scorers, half, options in ((3, 17, 2, 0, LabelSyncOptions(beam_size=3, sentence_end=2)),
                                                (8, 300, 4, 2, LabelSyncOptions(beam_size=8, sentence_end=2,
                                                                                score_threshold=3.0)),
                                                (32, 40, 1, 0, LabelSyncOptions(beam_size=32, sentence_end=2)),
                                                (4, 50, 2, 1, LabelSyncOptions(beam_size=4, sentence_end=2,
                                                                               min_length=5))):
        want, got = both_selections(cupy, beam, beam, vocab, scorers, options, num_groups=5, half_scorers=half)
        if not all(np.array_equal(got[name], want[name]) for name in ("parents", "labels", "scores")):
            print(f"MISMATCH: label step beam {beam}", file=sys.stderr)
            return 2
    from tests.test_ctc_prefix_kernel import mismatches as ctc_prefix_mismatches
    from tests.test_ctc_prefix_kernel import search_mismatch
    from tests.test_score_maxima import mismatches as maxima_mismatches
    from tests.test_ctc_frame_scorers import mismatches as scorer_frame_mismatches
    from tests.test_hf_step_inputs import mismatches as step_input_mismatches
    from tests.test_log_softmax_kernel import mismatches as log_softmax_mismatches
    from tests.test_label_step_separate import step_mismatches as separate_mismatches
    from tests.test_ctc_frame_graphs import replay_mismatches

    for name, problems in (("non-finite maxima", maxima_mismatches(cupy)),
                           ("ctc-prefix scorer", ctc_prefix_mismatches(cupy, exact=False)),
                           ("joint CTC/attention search", [m for m in [search_mismatch(cupy)] if m]),
                           ("CTC prefix search with scorers", scorer_frame_mismatches(cupy, exact=False)),
                           ("label step with separate finished lists", separate_mismatches(cupy, seeds=range(2))),
                           ("a Hugging Face step's inputs", step_input_mismatches(cupy)),
                           ("log-softmax of logits", log_softmax_mismatches(cupy)),
                           ("CTC frames with an LM replayed as CUDA graphs", replay_mismatches(cupy))):
        if problems:
            print(f"MISMATCH: {name}: {problems[:3]}", file=sys.stderr)
            return 2
    cupy.cuda.runtime.deviceSynchronize()
    print("gpu_sanitize_search: all results matched")
    return 0


if __name__ == "__main__":
    sys.exit(main())
