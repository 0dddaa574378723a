from driverd.host.osrelease import parse_os_release, read_os
from driverd.root import Root


def test_quotes_and_escapes():
    vals, bad = parse_os_release('ID=ubuntu\nVERSION_ID="22.04"\nPRETTY_NAME=\'Ubuntu 22.04.4 LTS\'\n'
                                 'ID_LIKE="rhel fedora"\n# comment\n\nNAME="A \\"quoted\\" name"\n')
    assert vals["ID"] == "ubuntu" and vals["VERSION_ID"] == "22.04"
    assert vals["PRETTY_NAME"] == "Ubuntu 22.04.4 LTS" and vals["NAME"] == 'A "quoted" name'
    assert not bad


def test_malformed_lines_are_warnings(tmp_path):
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/os-release").write_text('ID=rhel\nthis is not valid\nVERSION_ID="9.4\n')
    w = []
    o = read_os(Root(tmp_path), w)
    assert o.id == "rhel" and o.version_id is None
    assert len(w) == 2 and "line 2" in w[0] and "unbalanced" in w[1]


def test_fallback_and_missing(tmp_path):
    (tmp_path / "usr/lib").mkdir(parents=True)
    (tmp_path / "usr/lib/os-release").write_text("ID=rocky\nVERSION_ID=9.3\nID_LIKE=\"rhel centos fedora\"\n")
    o = read_os(Root(tmp_path), [])
    assert (o.id, o.version_id, o.id_like, o.source) == ("rocky", "9.3", ("rhel", "centos", "fedora"), "/usr/lib/os-release")
    w = []
    assert read_os(Root(tmp_path / "empty"), w).id == "unknown" and w
