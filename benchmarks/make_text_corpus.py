"""The convergence benchmark's second corpus: real English prose, offline. Python 3.11's documentation
(the reStructuredText sources Debian's `python3.11-doc` package ships under html/_sources/: the tutorial,
the library and language references, the HOWTOs, What's New; PSF licence), one document per page, a
byte-level BPE of 2,048 ids (the demo model's vocabulary, EOS id 0) trained on it, and prepare_data.py's
shards with a 5% validation split.

    apt-get download python3.11-doc && dpkg-deb -x python3.11-doc_*.deb /tmp/pydoc
    python benchmarks/make_text_corpus.py /tmp/pydoc/usr/share/doc/python3.11/html/_sources data/pydocs
    python benchmarks/bench_convergence.py --config cpu --set data_dir=data/pydocs ...
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

VOCAB = 2048


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: make_text_corpus.py SOURCES_DIR OUTPUT_DIR", file=sys.stderr)
        return 2
    src, out = Path(argv[0]), Path(argv[1])
    pages = sorted(src.rglob("*.rst.txt"))
    if not pages:
        print(f"{src}: no *.rst.txt pages (extract python3.11-doc's html/_sources there)", file=sys.stderr)
        return 2
    from utils.data.demo import train_tokenizer

    texts = [p.read_text(encoding="utf-8", errors="replace") for p in pages]
    tokenizer = train_tokenizer(texts, VOCAB)
    with tempfile.TemporaryDirectory() as tmp:
        tok = Path(tmp) / "tokenizer.json"
        tokenizer.save(str(tok))
        corpus = Path(tmp) / "corpus"
        for p in pages:  # one .txt document per page
            dest = corpus / p.relative_to(src).with_suffix("")
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.with_suffix(".txt").write_text(p.read_text(encoding="utf-8", errors="replace"), encoding="utf-8")
        return subprocess.call([sys.executable, str(REPO_ROOT / "prepare_data.py"), "--input", str(corpus),
                                "--tokenizer", str(tok), "--output", str(out), "--workers", "1",
                                "--val-fraction", "0.05", "--shard-tokens", "262144", "--no-progress"])


if __name__ == "__main__":
    sys.exit(main())
