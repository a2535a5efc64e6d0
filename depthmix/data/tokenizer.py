"""Hugging Face ``tokenizers`` files, the way Megatron's GPTDataset and our trainer use them.

The papers train with the GPT-NeoX tokenizer: ``<|endoftext|>`` (id 0) is BOS, EOS and the
end-of-document separator, ``<|padding|>`` (id 1) pads. :func:`train_bpe_tokenizer` makes a
small byte-level BPE with the same convention for the embedded corpus, and
:class:`HFTokenizer` loads any ``tokenizers`` JSON file (the NeoX one, ours, others) by path.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Iterable, Optional, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from depthmix.config.schema import ConfigError

EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|padding|>"
SPECIAL_TOKENS = [EOD_TOKEN, PAD_TOKEN]  # ids 0 and 1, in this order (GPT-NeoX convention)

# End-of-document tokens of other common tokenizer files, tried in order after ours.
_EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
_PAD_CANDIDATES = (PAD_TOKEN, "<pad>", "<|pad|>", "[PAD]")


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, path: Optional[str] = None
                        ) -> Tokenizer:
    """Train a byte-level BPE on ``texts``; ``<|endoftext|>`` = 0, ``<|padding|>`` = 1.

    The vocabulary holds the two special tokens, the 256 byte symbols and up to
    ``vocab_size - 258`` merges (fewer when the corpus runs out of pairs). Byte-level
    without a normaliser: every string round-trips exactly. Saved to ``path`` if given.
    """
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size={vocab_size} must be >= 258 (2 special tokens + 256 bytes)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.token_to_id(EOD_TOKEN) == 0 and tok.token_to_id(PAD_TOKEN) == 1
    if path is not None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        tok.save(tmp)
        os.replace(tmp, path)
    return tok


class HFTokenizer:
    """A ``tokenizers`` JSON file with what Megatron's GPTDataset and the trainer ask for.

    GPTDataset (megatron-core 0.16.1) reads ``eod`` (loss/position masks), ``pad`` (fills
    the last partial sample, loss-masked), ``vocab_size`` (only to pick the token dtype),
    and ``unique_identifiers`` (part of the hash that names its index cache files); it
    duck-types the tokenizer, so no Megatron base class is needed. ``encode``/``decode``
    are the trainer's names, ``tokenize``/``detokenize`` Megatron's.

    Args:
        path: a ``tokenizer.json`` written by ``tokenizers`` (``Tokenizer.save``).
    """

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file {path} not found")
        self.path = os.path.abspath(path)
        self._tok = Tokenizer.from_file(self.path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eod = self._first_id(_EOD_CANDIDATES)
        if eod is None:
            raise ValueError(f"tokenizer {path} has none of the end-of-document tokens "
                             f"{list(_EOD_CANDIDATES)}")
        self.eod = eod
        pad = self._first_id(_PAD_CANDIDATES)
        # No pad token: Megatron then pads with a reserved id that it masks (see
        # MegatronDataset: a pad equal to eod is detected and replaced).
        self.pad = eod if pad is None else pad
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("tokenizer_path", self.path),
             ("vocab_size", self.vocab_size), ("eod", self.eod), ("pad", self.pad)])

    def _first_id(self, candidates: Sequence[str]) -> Optional[int]:
        for token in candidates:
            i = self._tok.token_to_id(token)
            if i is not None:
                return i
        return None

    @property
    def eos(self) -> int:
        return self.eod

    @property
    def bos(self) -> int:
        return self.eod

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, no special tokens added."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        """Text of ``ids`` (a list, numpy array or tensor); special tokens are kept."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._tok.decode(list(ids), skip_special_tokens=False)

    tokenize = encode
    detokenize = decode

    def __repr__(self) -> str:
        return (f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size}, eod={self.eod}, "
                f"pad={self.pad})")


def load_tokenizer(path: str, option: str, model_vocab_size: int) -> HFTokenizer:
    """Load a tokenizers JSON file for the config option ``option``; a :class:`ConfigError`
    names the option when it is missing, unusable, or larger than the model's vocabulary."""
    if not path or not os.path.isfile(os.path.expanduser(path)):
        raise ConfigError(f"{option}={path} not found (a tokenizers JSON file)")
    try:
        tok = HFTokenizer(os.path.expanduser(path))
    except Exception as e:  # not a tokenizers file, no end-of-document token, ...
        raise ConfigError(f"{option}={path}: cannot use it as a tokenizer: {e}") from None
    if tok.vocab_size > model_vocab_size:
        raise ConfigError(f"{option}={path} has {tok.vocab_size} tokens, more than "
                          f"model.vocab_size={model_vocab_size}")
    return tok
