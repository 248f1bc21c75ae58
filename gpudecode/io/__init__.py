"""Readers, writers and scoring at the edge of the toolkit: the search never opens a file.

Readers yield ``Utterance(id, features (T, F) float32)`` lazily from a folder of ``.npy``, an
``.npz``, HDF5 (RETURNN layout), Kaldi ark/scp, or audio through the log-mel front end.
``io.prompts`` reads per-utterance token prompts (a prompt file).
Writers write text, JSON lines and CTM incrementally; ``score_wer`` computes WER/CER.
Optional packages (h5py, kaldiio, soundfile, jiwer) are imported only by the code that uses
them.
"""

from gpudecode.io.errors import (
    FeatureError,
    InputError,
    ResultFileError,
    VocabularyError,
)
from gpudecode.io.features import (
    BatchSizing,
    FeatureSource,
    Utterance,
    bucket_by_length,
    check_features,
)
from gpudecode.io.frontend import (
    FrontEndError,
    LogMelFrontEnd,
    LogMelOptions,
    mel_filterbank,
)
from gpudecode.io.prompts import (
    PROMPT_FORMATS,
    PromptedSource,
    PromptError,
    PromptSource,
    parse_prompts,
    read_prompts,
)
from gpudecode.io.readers import detect_format, open_features
from gpudecode.io.vocabulary import Vocabulary, Word, merge_words
from gpudecode.io.wer import read_transcripts, score_wer
from gpudecode.io.writers import (
    Hypothesis,
    ResultFormatter,
    ResultWriter,
    UtteranceResult,
    read_done_ids,
)

__all__ = [
    "FeatureError", "FeatureSource", "FrontEndError", "Hypothesis", "InputError",
    "LogMelFrontEnd", "LogMelOptions", "PROMPT_FORMATS", "PromptError", "PromptSource",
    "PromptedSource", "ResultFileError", "ResultFormatter", "ResultWriter", "Utterance",
    "UtteranceResult", "Vocabulary", "VocabularyError", "Word", "BatchSizing", "bucket_by_length",
    "check_features", "detect_format", "mel_filterbank", "merge_words", "open_features",
    "parse_prompts", "read_prompts",
    "read_done_ids", "read_transcripts", "score_wer",
]
