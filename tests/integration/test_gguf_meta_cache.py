"""service.worker.gguf_meta_cache with the default model's GGUF file: the config and
tokenizer read back from the cache are transformers' own from the file (vocabulary, special
tokens, chat template, encodings, config), a changed file builds them again, and a damaged
or unwritable cache never stops a load."""

from __future__ import annotations

import os
import shutil

import pytest

from service.worker import gguf_meta_cache
from service.worker.gguf_meta_cache import DONE, config_and_tokenizer, meta_dir
from service.worker.gguf_parse import shared_gguf_parse
from service.worker.loader import _source, default_model_path

TEXTS = ["Hello world!", "  spaces\tand\nnewlines  ", "émoji 🤖 and 中文",
         "<|im_start|>user\nhi<|im_end|>"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.fixture
def gguf_copy(tmp_path, monkeypatch):
    """A copy of the default model's GGUF file in a folder of its own, and an empty cache."""
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    src = default_model_path()
    path = tmp_path / "model" / os.path.basename(src)
    path.parent.mkdir()
    shutil.copyfile(src, path)
    return str(path)


def _load(path: str):
    folder, kw = _source(path)
    with shared_gguf_parse():
        return config_and_tokenizer(path, folder, kw)


def test_the_cache_gives_transformers_own_config_and_tokenizer(gguf_copy) -> None:
    config, tok, hit = _load(gguf_copy)
    assert not hit and (meta_dir(gguf_copy) / DONE).exists()
    config2, tok2, hit2 = _load(gguf_copy)
    assert hit2
    assert config.to_dict() == config2.to_dict()
    assert tok.get_vocab() == tok2.get_vocab() and tok.chat_template == tok2.chat_template
    assert tok.all_special_tokens == tok2.all_special_tokens
    assert (tok.eos_token_id, tok.bos_token_id) == (tok2.eos_token_id, tok2.bos_token_id)
    assert [tok.encode(t) for t in TEXTS] == [tok2.encode(t) for t in TEXTS]
    assert tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == \
        tok2.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = list(range(100, 400))
    assert tok.decode(ids) == tok2.decode(ids)


def test_a_changed_file_or_a_damaged_cache_builds_it_again(gguf_copy, monkeypatch) -> None:
    _load(gguf_copy)
    first = meta_dir(gguf_copy)
    st = os.stat(gguf_copy)
    os.utime(gguf_copy, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert meta_dir(gguf_copy) != first  # the key follows the file's modification time
    _, _, hit = _load(gguf_copy)
    assert not hit and (meta_dir(gguf_copy) / DONE).exists()
    where = meta_dir(gguf_copy)
    (where / "tokenizer.json").write_text("{ not json")
    config, tok, hit = _load(gguf_copy)  # unreadable: built from the file, the load goes on
    assert not hit and tok.encode("Hello world!") and config.model_type == "llama"
    shutil.rmtree(where)
    monkeypatch.setattr(gguf_meta_cache, "cache_dir", lambda: where.parent.parent / "f" / "k")
    (where.parent.parent / "f").write_text("a file where the cache's folder would be")
    _, tok, hit = _load(gguf_copy)  # cannot be written: served anyway
    assert not hit and tok.encode("Hello world!")
