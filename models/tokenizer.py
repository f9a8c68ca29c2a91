"""A character-level tokenizer for the tiny test models.

Role: gives the tiny models (models/tiny.py) a real `transformers` tokenizer without downloading
anything. Invariant: one token per character of `CHARS`, fixed ids (specials first: <pad>=0,
<bos>=1, <eos>=2, <unk>=3), no special tokens added on encode, and decode joins characters with
nothing in between, so `decode(encode(s)) == s` for every string over `CHARS`. The tokenizer
round-trips through `save_pretrained` / `AutoTokenizer.from_pretrained`.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = "0123456789abcdefghijklmnopqrstuvwxyz +-*=:?,.!()<>"


def char_vocab() -> dict[str, int]:
    """Token -> id: the specials, then one id per character of CHARS."""
    tokens = list(SPECIALS) + list(CHARS)
    return {tok: i for i, tok in enumerate(tokens)}


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer as a `PreTrainedTokenizerFast`."""
    core = Tokenizer(models.WordLevel(vocab=char_vocab(), unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>", padding_side="left")
