import json

from depthmix.data.corpus import generate_document, iter_documents, write_corpus


def test_corpus_is_deterministic_and_prefix_stable():
    a = list(iter_documents(50, seed=3))
    assert a == list(iter_documents(50, seed=3))
    # Document i depends only on (seed, i): a longer corpus starts with the shorter one.
    assert list(iter_documents(80, seed=3))[:50] == a
    assert a != list(iter_documents(50, seed=4))
    assert generate_document(3, 7) == a[7]


def test_corpus_is_varied():
    docs = list(iter_documents(400))
    assert len(set(docs)) == len(docs)
    words = {w.strip('.,!?"') for d in docs for w in d.split()}
    assert len(words) > 500
    # All six document kinds occur.
    text = "\n".join(docs)
    for marker in ("Once upon a time", "Now ", " comes after ", '" asked ', " town near ",
                   " has four legs."):
        assert marker in text, marker


def test_write_corpus_jsonl(tmp_path):
    path = tmp_path / "sub" / "corpus.jsonl"
    write_corpus(str(path), 20, seed=1)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["text"] for line in lines] == list(iter_documents(20, seed=1))
