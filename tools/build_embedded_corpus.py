#!/usr/bin/env python3
"""Rebuild the embedded English corpus (data/corpus/python-docs-3.11.jsonl.gz) from the Debian package
python3.11-doc (reST sources of the Python 3.11 documentation, PSF License). Needs apt; not used at run time.

    apt-get download python3.11-doc && dpkg-deb -x python3.11-doc_*.deb /tmp/pydoc
    python tools/build_embedded_corpus.py /tmp/pydoc/usr/share/doc/python3.11/html/_sources
"""
import gzip
import json
import re
import sys
from pathlib import Path

SECTIONS = ("tutorial", "howto", "faq", "reference")  # four domains (used by tools/probe_moe.py)
DROP = re.compile(r"^\s*\.\. (index|_[^:]*|sectionauthor|moduleauthor|highlight|versionadded|versionchanged|"
                  r"deprecated|seealso|toctree|module|currentmodule)::?.*$")


def main():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sources", help="the _sources directory of the unpacked python3.11-doc package")
    src = Path(ap.parse_args().sources)
    if not all((src / sec).is_dir() for sec in SECTIONS):
        ap.error(f"{src} is not the Python documentation's _sources directory (needs {', '.join(SECTIONS)}/)")
    out = Path(__file__).resolve().parent.parent / "data" / "corpus" / "python-docs-3.11.jsonl.gz"
    tmp = out.with_name(out.name + ".tmp")  # the embedded corpus is replaced only by a complete new one
    n = 0
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        for sec in SECTIONS:
            for p in sorted((src / sec).glob("*.rst.txt")):
                lines = [ln for ln in p.read_text(encoding="utf-8").splitlines() if not DROP.match(ln)]
                text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
                if len(text) > 200:
                    f.write(json.dumps({"text": text, "domain": sec, "source": f"python-3.11-docs/{sec}/{p.name}"}) + "\n")
                    n += 1
    if n == 0:
        tmp.unlink()
        ap.error(f"no documents found under {src}; {out} is unchanged")
    tmp.replace(out)
    print(f"wrote {n} documents to {out}")


if __name__ == "__main__":
    main()
