"""Incremental detokenization: the streamed pieces add up to decoding everything at once, characters whole."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.tokenizer import IncrementalDetokenizer, load_tokenizer

CORPUS = ["héllo wörld", "日本語のテキスト", "emoji 🙂🚀 mixed ascii", "naïve café crème brûlée", "plain words here"]


@pytest.fixture(scope="module")
def byte_bpe(tmp_path_factory):
    """A byte-level BPE tokenizer (multi-byte characters split over several tokens), saved and loaded from disk."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # few merges: most multi-byte characters stay split over several byte tokens
    trainer = trainers.BpeTrainer(vocab_size=270, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 5, trainer)
    path = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return load_tokenizer(path)


def stream(tokenizer, ids):
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(t) for t in ids]
    return pieces, pieces + [detok.flush()]


@pytest.mark.parametrize("text", CORPUS)
def test_pieces_add_up_and_never_split_a_character(byte_bpe, text):
    ids = byte_bpe.encode(text)
    pieces, with_tail = stream(byte_bpe, ids)
    assert "".join(with_tail) == byte_bpe.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    if any(ord(c) > 127 for c in text):  # some character took more than one token: a piece was held back
        assert len([p for p in pieces if p]) < len(ids)


@given(st.lists(st.integers(0, 269), min_size=1, max_size=40))
def test_any_token_sequence_streams_to_its_decoding(byte_bpe, ids):
    _, with_tail = stream(byte_bpe, ids)
    assert "".join(with_tail) == byte_bpe.decode(ids)


def test_no_tokenizer_files_means_no_tokenizer(tmp_path):
    assert load_tokenizer(tmp_path) is None and load_tokenizer(None) is None
