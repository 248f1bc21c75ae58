"""The label-synchronous search's peer semantics: ``min_length``, the separate finished lists of
``finished="separate"`` (transformers' rules) and ``"separate-genai"`` (ONNX Runtime GenAI's
rules), ``early_stopping`` and ``length_counts``.

Oracles: a per-hypothesis Python version of each peer's beam search (float64, written from the
peers' sources: transformers 5.24 ``_beam_search``, onnxruntime-genai ``BeamSearchScorer``) on
random trigram tables; GenAI's own beam search on the committed GenAI builder export
(``tests/fixtures/peers/genai/``, made by ``tools/peer-fixtures/genai.py``; live under ``-m
peers``); transformers' own ``generate`` is ``test_peer_transformers.py``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from gpudecode.config import SearchConfig
from gpudecode.scorers import UtteranceBatch
from gpudecode.search import LabelSyncOptions, label_sync_search
from gpudecode.search.registry import SearchSetup, search_type
from gpudecode.session import SessionOptions
from gpudecode.states.options import StateManagerOptions
from tests.test_search_label_sync import TrigramTableScorer, random_tables, table_logp

V, EOS, BEAM = 6, 2, 3
LIMITS = np.array([5, 7, 4, 6])
PROMPT_SIZES = np.array([2, 5, 1, 3])
ROOT = Path(__file__).resolve().parents[1]
GENAI = ROOT / "tests" / "fixtures" / "peers" / "genai"


# --- the peers' beam searches, one hypothesis at a time ------------------------------------------
def reference(logp_fn, u: int, options: LabelSyncOptions, limit: int, prompt: int):
    """The finished list of utterance ``u`` as [(labels incl. sentence-end, score)], best first."""
    beam, lp, genai = options.beam_size, options.length_norm_scale, options.finished == "separate-genai"

    def counted(num_labels: int, ended: bool) -> int:
        return num_labels if options.length_counts == "labels" else prompt + num_labels - ended

    def rank(score: float, length: int) -> float:
        return score / max(length, 1) ** lp if lp else score

    finished: list[tuple[float, tuple, float]] = []  # (rank, sequence, score), best first

    def add(item):  # best first, a new entry after equal ones, at most beam entries
        if len(finished) == beam and item[0] <= finished[-1][0]:
            return
        at = next((i for i, f in enumerate(finished) if item[0] > f[0]), len(finished))
        finished.insert(at, item)
        del finished[beam:]

    running, hopeful = [((), 0.0)], True
    for step in range(1, limit + 1):
        cands = []
        for seq, score in running:  # lane order, then label order: the tie-break order
            logp = logp_fn(u, seq).copy()
            if len(seq) < options.min_length:
                logp[options.sentence_end] = -np.inf
            cands += [(score + logp[label], seq + (label,)) for label in range(V)]
        top = sorted(range(len(cands)), key=lambda i: -cands[i][0])[:2 * beam]  # stable
        at_limit = step == limit
        full_before = len(finished) == beam
        new_running = []
        for j, i in enumerate(top):
            score, seq = cands[i]
            if score == -np.inf:
                continue
            ended = seq[-1] == options.sentence_end
            if ended or (at_limit and not genai):
                blocked = not hopeful or (not genai and options.early_stopping is True and full_before)
                if j < beam and not blocked:
                    add((rank(score, counted(len(seq), ended)), seq, score))
            elif len(new_running) < beam:
                new_running.append((seq, score))
        if genai:
            done = False
            if len(finished) == beam:
                best = rank(cands[top[0]][0], counted(step - 1, False))
                done = options.early_stopping is True or not finished[-1][0] < best
            if at_limit and not done:
                for seq, score in new_running:
                    add((rank(score, counted(len(seq), False)), seq, score))
        elif not at_limit:  # (at the limit every candidate ended)
            open_length = limit if options.early_stopping == "never" and lp > 0 else step
            best_open = rank(new_running[0][1], counted(open_length, False))
            full = len(finished) == beam
            hopeful = hopeful and (not full or best_open > finished[-1][0])
            done = not hopeful or (options.early_stopping is True and full)
        running = new_running
        if at_limit or done:
            break
    return [(seq, score) for _, seq, score in finished[:options.num_best]]


def table_batch(tables) -> UtteranceBatch:
    num = len(LIMITS)
    prompts = np.zeros((num, PROMPT_SIZES.max()), np.int64)  # the table scorer reads no prompt: sizes only
    return UtteranceBatch(ids=[f"u{u}" for u in range(num)], input_lengths=LIMITS,
                          inputs={"table": tables, "prompt": prompts}, sizes={"prompt": PROMPT_SIZES})


SETTINGS = [
    dict(finished="separate", early_stopping=False, length_norm_scale=1.0),
    dict(finished="separate", early_stopping=True, length_norm_scale=1.0),
    dict(finished="separate", early_stopping="never", length_norm_scale=1.0),
    dict(finished="separate", early_stopping=False, length_norm_scale=0.0, min_length=2),
    dict(finished="separate", early_stopping=False, length_norm_scale=0.7, length_counts="prompt-and-labels"),
    dict(finished="separate-genai", early_stopping=True, length_norm_scale=1.0, length_counts="prompt-and-labels"),
    dict(finished="separate-genai", early_stopping=False, length_norm_scale=1.0, length_counts="prompt-and-labels"),
    dict(finished="separate-genai", early_stopping=False, length_norm_scale=0.0, min_length=3),
]


@pytest.mark.parametrize("continuous", [None, 2], ids=["static", "continuous"])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{v}" for v in s.values()))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_separate_lists_equal_the_peers_reference(seed, settings, continuous):
    tables = random_tables(seed, len(LIMITS), V, EOS, eos_bias=1.0)
    options = LabelSyncOptions(beam_size=BEAM, sentence_end=EOS, max_labels_per_input=1.0, nbest=BEAM, **settings)
    nbest = label_sync_search([("lm", TrigramTableScorer(V), 1.0)], table_batch(tables), options,
                              max_active_utterances=continuous)
    for u, hyps in enumerate(nbest):
        expected = reference(lambda u, seq: table_logp(tables, u, seq), u, options, int(LIMITS[u]),
                             int(PROMPT_SIZES[u]))
        got = [tuple(h.labels) + (EOS,) * (h.length - len(h.labels)) for h in hyps]
        assert got == [seq for seq, _ in expected], f"utterance {u}"
        np.testing.assert_allclose([h.score for h in hyps], [score for _, score in expected], atol=1e-4)
        assert all(len(h.labels) >= options.min_length for h in hyps)


@pytest.mark.gpu
@pytest.mark.parametrize("continuous", [None, 2], ids=["static", "continuous"])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{v}" for v in s.values()))
def test_separate_lists_on_cupy_equal_numpy(settings, continuous):
    import cupy

    tables = random_tables(0, len(LIMITS), V, EOS, eos_bias=1.0)
    options = LabelSyncOptions(beam_size=BEAM, sentence_end=EOS, max_labels_per_input=1.0, nbest=BEAM, **settings)
    results = [label_sync_search([("lm", TrigramTableScorer(V), 1.0)], table_batch(tables), options, xp=xp,
                                 max_active_utterances=continuous) for xp in (np, cupy)]
    for cpu, gpu in zip(*results):
        assert [h.labels for h in cpu] == [h.labels for h in gpu]
        np.testing.assert_allclose([h.score for h in cpu], [h.score for h in gpu], atol=1e-4)


def test_the_modes_differ_where_the_peers_do():
    """On these tables the three modes do not all agree (the test above is no tautology)."""
    tables = random_tables(0, len(LIMITS), V, EOS, eos_bias=1.0)
    results = {}
    for finished in ("in-beam", "separate", "separate-genai"):
        options = LabelSyncOptions(beam_size=BEAM, sentence_end=EOS, max_labels_per_input=1.0, finished=finished,
                                   length_norm_scale=1.0)
        nbest = label_sync_search([("lm", TrigramTableScorer(V), 1.0)], table_batch(tables), options)
        results[finished] = [[tuple(h.labels) for h in hyps] for hyps in nbest]
    assert len({str(r) for r in results.values()}) == 3


# --- GenAI's own beam search --------------------------------------------------------------------
def genai_document() -> dict:
    return json.loads((GENAI / "expected.json").read_text())


def genai_beam_cases() -> list[str]:
    return [k for k, v in genai_document().items() if k.startswith("beam") and isinstance(v, dict)
            and "sequences" in v]


def genai_decode(case: dict, max_length: int, continuous=None, device: str = "cpu") -> list[list[list[int]]]:
    """The toolkit's n-best lists of the GenAI fixture's prompts, as GenAI's sequences (prompt +
    generated tokens, EOS left out)."""
    from gpudecode.scorers.prefix_lm import PrefixLmScorer

    doc = genai_document()
    prompts = doc["prompts"]
    sizes = np.array([len(p) for p in prompts])
    table = np.zeros((len(prompts), sizes.max()), np.int64)
    for u, prompt in enumerate(prompts):
        table[u, :len(prompt)] = prompt
    batch = UtteranceBatch(ids=[f"p{u}" for u in range(len(prompts))], input_lengths=max_length - sizes,
                           inputs={"prompt": table}, sizes={"prompt": sizes})
    options = LabelSyncOptions(beam_size=case["num_beams"], sentence_end=doc["eos"], max_labels_per_input=1.0,
                               finished="separate-genai", early_stopping=case.get("early_stopping", True),
                               length_norm_scale=case.get("length_penalty", 1.0), length_counts="prompt-and-labels",
                               nbest=case["num_beams"])
    lm = PrefixLmScorer(model=str(GENAI), vocab_size=128, scores_kind="logits",
                        state_manager=StateManagerOptions(type=f"transformer-{device}"),
                        session_options=SessionOptions(device=device))
    xp = np
    if device == "cuda":
        import cupy as xp
    nbest = label_sync_search([("lm", lm, 1.0)], batch, options, max_active_utterances=continuous, xp=xp)
    return [[prompt + h.labels for h in hyps] for prompt, hyps in zip(prompts, nbest)]


@pytest.mark.parametrize("continuous", [None, 2], ids=["one-batch", "continuous"])
@pytest.mark.parametrize("case", genai_beam_cases())
def test_separate_genai_equals_genai_beam_search(case, continuous):
    """GenAI's beam search (num_return_sequences = num_beams, its defaults early_stopping true and
    length_penalty 1), one prompt per generator: the whole n-best lists, in order."""
    doc = genai_document()
    expected = doc[case]
    got = genai_decode(expected, expected.get("max_length", doc["max_length"]), continuous)
    assert got == expected["sequences"]


@pytest.mark.gpu
def test_the_fp32_genai_export_is_refused_on_cuda():
    """The fixture is GenAI's fp32 CPU export: ONNX Runtime's CUDA GroupQueryAttention has no
    float32 kernel, so under the CUDA provider those nodes land on the CPU with copies every call;
    the session refuses that at load and names the copies, rather than decoding it slowly. (The
    separate-genai selection on CuPy: ``test_separate_lists_on_cupy_equal_numpy``.)"""
    from gpudecode.session.runner import SessionError

    doc = genai_document()
    with pytest.raises(SessionError, match="nodes were placed on the CPU and data is copied between providers"):
        genai_decode(doc[genai_beam_cases()[0]], doc["max_length"], device="cuda")


@pytest.mark.peers
@pytest.mark.parametrize("case", genai_beam_cases())
def test_separate_genai_equals_live_genai_beam_search(case):
    spec = importlib.util.spec_from_file_location("genai_fixture", ROOT / "tools" / "peer-fixtures" / "genai.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    doc = genai_document()
    settings = doc[case]
    max_length = settings.get("max_length", doc["max_length"])
    live = [module.generate(GENAI, [p], settings["num_beams"], with_scores=False, max_length=max_length)[0]
            for p in doc["prompts"]]
    assert live == settings["sequences"]
    assert genai_decode(settings, max_length) == live


# --- options and config -------------------------------------------------------------------------
@pytest.mark.parametrize("fields, name", [
    (dict(min_length=-1), "min_length"),
    (dict(finished="hf"), "finished"),
    (dict(early_stopping="sometimes"), "early_stopping"),
    (dict(length_counts="tokens"), "length_counts"),
    (dict(length_counts="prompt-and-labels"), "length_counts"),  # in-beam ranks by label counts
    (dict(finished="separate-genai", early_stopping="never"), "early_stopping"),
    (dict(finished="separate", score_threshold=5.0), "score_threshold"),
])
def test_bad_options_are_refused_by_name(fields, name):
    with pytest.raises(ValueError, match=f"LabelSyncOptions.{name}"):
        LabelSyncOptions(beam_size=2, sentence_end=0, **fields)


def test_defaults_are_todays_search():
    options = LabelSyncOptions(beam_size=2, sentence_end=0)
    assert (options.min_length, options.finished, options.early_stopping, options.length_counts) == (
        0, "in-beam", False, "labels")
    config = SearchConfig()
    assert (config.min_length, config.finished, config.early_stopping, config.length_counts) == (
        0, "in-beam", False, "labels")


def test_config_keys_reach_the_options():
    config = SearchConfig(beam_size=4, nbest=2, min_length=3, finished="separate", early_stopping="never",
                          length_counts="prompt-and-labels", length_norm_scale=0.5)
    options = search_type("label-sync").make_options(SearchSetup(config=config, sentence_end=7))
    assert (options.min_length, options.finished, options.early_stopping, options.length_counts,
            options.nbest, options.length_norm_scale) == (3, "separate", "never", "prompt-and-labels", 2, 0.5)
    with pytest.raises(ValueError, match="length_counts"):
        SearchConfig(length_counts="prompt-and-labels")
    with pytest.raises(ValueError, match="early_stopping"):
        SearchConfig(finished="separate-genai", early_stopping="never")
