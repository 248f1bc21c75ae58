"""Joint CTC/attention decoding: the attention decoder scores every label, the ctc-prefix scorer
the pre-beam candidates; every n-best score equals the two independent oracles' weighted sum."""

import numpy as np
import pytest

from gpudecode.scorers import UtteranceBatch
from gpudecode.scorers.ctc_prefix import CtcPrefixScorer
from tests.test_onnx_decoder_search import EOS, Setup, search, terminated, xp_of

BLANK = 2


def ctc_forward_logp(log_probs: np.ndarray, labels) -> float:
    """log P(labels | frames) by the CTC forward recursion over the blank-extended sequence."""
    extended = [BLANK]
    for label in labels:
        extended += [label, BLANK]
    alpha = np.full(len(extended), -np.inf)
    alpha[0] = log_probs[0, BLANK]
    if len(extended) > 1:
        alpha[1] = log_probs[0, extended[1]]
    for t in range(1, log_probs.shape[0]):
        previous = alpha.copy()
        for s, label in enumerate(extended):
            paths = [previous[s]]
            if s >= 1:
                paths.append(previous[s - 1])
            if s >= 2 and label != BLANK and label != extended[s - 2]:
                paths.append(previous[s - 2])
            alpha[s] = np.logaddexp.reduce(paths) + log_probs[t, label]
    return float(np.logaddexp(alpha[-1], alpha[-2]) if len(extended) > 1 else alpha[-1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_joint_scores_equal_the_sum_of_the_two_oracles(device):
    xp = xp_of(device)
    setup = Setup(3, num_utts=3, device=device)
    rng = np.random.default_rng(3)
    frames = np.array([7, 5, 6])
    logits = rng.standard_normal((3, frames.max(), 12)).astype(np.float32) * 2
    logits[:, :, BLANK] += 1.0
    log_probs = logits - np.log(np.exp(logits).sum(axis=2, keepdims=True))
    base = setup.batch(xp=xp)
    batch = UtteranceBatch(ids=base.ids, input_lengths=base.input_lengths,
                           inputs={**base.inputs, "log-probs": xp.asarray(log_probs)},
                           sizes={"log-probs": frames})
    ctc = CtcPrefixScorer(vocab_size=12, sentence_end=EOS, blank=BLANK)
    nbest = search([("decoder", setup.scorer(), 0.7), ("ctc", ctc, 0.3)], batch, xp=xp,
                   beam_size=6, pre_beam_size=8, max_labels=12, max_labels_per_input=3.0)
    checked = 0
    for u, hyps in enumerate(nbest):
        for hyp in hyps:
            assert BLANK not in hyp.labels  # CTC gives blank-as-label no probability
            decoder = setup.oracle_score(setup.decoder, u, hyp.labels, terminated(hyp))
            assert hyp.scores["decoder"] == pytest.approx(decoder, abs=1e-4)
            if terminated(hyp):
                ctc_logp = ctc_forward_logp(log_probs[u, : frames[u]], hyp.labels)
                assert hyp.scores["ctc"] == pytest.approx(ctc_logp, abs=1e-4)
                assert hyp.score == pytest.approx(0.7 * decoder + 0.3 * ctc_logp, abs=1e-4)
                checked += 1
    assert checked >= 8  # with max_labels above the frame counts, CTC makes every hypothesis end
