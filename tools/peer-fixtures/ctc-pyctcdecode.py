"""Builds the pyctcdecode fixture: peaky CTC log-probs and pyctcdecode's best transcripts of them.

Run in the peers environment (pyctcdecode 0.5 installed with ``--no-deps`` plus ``pygtrie``), from
the repository root::

    PYTHONPATH=. .venv-peers/bin/python tools/peer-fixtures/ctc-pyctcdecode.py

Writes ``tests/fixtures/peers/pyctcdecode/``:

- ``log_probs.npy``: [U, T, V] float32, the first ``UTTERANCES`` of
  ``gpudecode.bench.cpu.peaky_log_probs`` of ``INPUT`` (the CPU bench's inputs, smaller);
- ``expected.json``: pyctcdecode's labels (blank ``""`` at 0, then single characters: the bench's),
  its default pruning (``token_min_logp``, ``beam_prune_logp``), and per beam the label indices of
  ``decode_beams``' best transcript of each utterance (no LM), with the number of utterances on
  which the toolkit — unpruned and with the same pruning as options — finds another best transcript
  when the fixture is made (``max_differing``: the tests' bound), and the peer's version.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "peers" / "pyctcdecode"
INPUT = {"num_utts": 24, "num_frames": 120, "vocab_size": 24, "seed": 28}
#: the first utterances of INPUT kept; on utterance 2 at beam 25 the toolkit unpruned ends on another
#: (more likely) transcript than pyctcdecode, with pyctcdecode's pruning on the same one
UTTERANCES = 8
BEAMS = (4, 8, 25)


def main() -> None:
    from pyctcdecode import build_ctcdecoder
    from pyctcdecode.constants import DEFAULT_MIN_TOKEN_LOGP, DEFAULT_PRUNE_LOGP

    from gpudecode.bench.cpu import CHARACTERS, peaky_log_probs
    from gpudecode.search import CtcPrefixOptions, ctc_prefix_search

    logging.getLogger("pyctcdecode").setLevel(logging.ERROR)
    log_probs = peaky_log_probs(**INPUT)[:UTTERANCES]
    labels = [""] + list(CHARACTERS[:INPUT["vocab_size"] - 1])
    index = {c: i for i, c in enumerate(labels)}
    decoder = build_ctcdecoder(labels)
    lengths = np.full(UTTERANCES, INPUT["num_frames"])
    cells = []
    for beam in BEAMS:
        best = [[index[c] for c in decoder.decode_beams(row, beam_width=beam)[0][0]] for row in log_probs]
        differing = {}
        for name, settings in (("unpruned", {}), ("pruned", {"token_min_logp": DEFAULT_MIN_TOKEN_LOGP,
                                                              "score_threshold": -DEFAULT_PRUNE_LOGP})):
            ours = ctc_prefix_search(log_probs, lengths, CtcPrefixOptions(beam_size=beam, nbest=1, **settings))
            differing[name] = [u for u, (h, b) in enumerate(zip(ours, best)) if h[0].labels != b]
        cells.append({"beam": beam, "best": best, "max_differing": len(differing["pruned"]),
                      "differing_when_made": differing})
        print(f"beam {beam}: toolkit unpruned differs on {differing['unpruned']}, pruned on {differing['pruned']}")
    OUT.mkdir(parents=True, exist_ok=True)
    np.save(OUT / "log_probs.npy", log_probs)
    document = {"input": INPUT, "utterances": UTTERANCES, "labels": labels, "token_min_logp": DEFAULT_MIN_TOKEN_LOGP,
                "beam_prune_logp": DEFAULT_PRUNE_LOGP, "call": "decode_beams(log_probs[u], beam_width=beam)[0][0]",
                "versions": {"pyctcdecode": importlib.metadata.version("pyctcdecode")}, "cells": cells}
    (OUT / "expected.json").write_text(json.dumps(document, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
