"""Write driverd's man pages from its own argument parsers (argparse-manpage, a development tool; the
pages are committed, and tests/test_manpages.py fails when they differ from what this produces):

    man/driverd.8            driverd and every command (the systemd units' Documentation=man:driverd(8))
    man/kubectl-driverd.1    the kubectl plugin

    python3 tools/gen_manpages.py            # rewrite them
    python3 tools/gen_manpages.py --check    # exit 1 when they are stale

Installed by hand with the units (README, Install): /usr/local/share/man/man8/, .../man1/.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PAGES = {
    "driverd.8": ("driverd", 8, "take NVIDIA GPU hosts to workload-ready and keep them there"),
    "kubectl-driverd.1": ("kubectl driverd", 1, "rolling NVIDIA driver upgrades across a Kubernetes cluster"),
}
_GLYPHS = {"\u2014": "\\(em", "\u2013": "\\(en", "\u2026": "...", "\u00d7": "\\(mu", "\u2192": "\\(->",
           "\u2019": "\\(cq", "\u201c": "\\(lq", "\u201d": "\\(rq"}
# the page's date is the only line that changes from day to day: compared without it
DATE_LINE = re.compile(r'^(\.TH "?[^"\s]+"? "?\d+"?) "[^"]*"', re.M)


def parser_of(prog: str) -> argparse.ArgumentParser:
    from driverd.cli import build_parser, kubectl_parser
    return kubectl_parser() if prog == "kubectl driverd" else build_parser()


def render(name: str) -> str:
    from argparse_manpage.manpage import Manpage
    from driverd import __version__
    prog, section, summary = PAGES[name]
    page = Manpage(parser_of(prog), _data={"prog": prog, "project_name": "driverd", "version": __version__,
                                           "manual_section": section, "manual_title": "driverd manual",
                                           "description": summary})
    text = str(page).rstrip("\n") + "\n"
    # the help's typography as groff's named characters: a C-locale terminal renders those too
    for ch, esc in _GLYPHS.items():
        text = text.replace(ch, esc)
    # the title is one word: the plugin's page is KUBECTL-DRIVERD(1), its text says `kubectl driverd`
    return text.replace(f'.TH {prog.upper()} ', f'.TH {prog.upper().replace(" ", "-")} ', 1)


def undated(text: str) -> str:
    return DATE_LINE.sub(r"\1 DATE", text)


def main() -> int:
    check = "--check" in sys.argv[1:]
    stale = []
    for name in PAGES:
        path = REPO / "man" / name
        new = render(name)
        old = path.read_text() if path.exists() else ""
        if undated(old) == undated(new):
            continue
        stale.append(name)
        if not check:
            path.parent.mkdir(exist_ok=True)
            path.write_text(new)
    if check and stale:
        print(f"stale man pages: {', '.join(stale)}; run python3 tools/gen_manpages.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
