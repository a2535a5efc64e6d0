"""tools/test_times.py: seconds per test file from pytest's JUnit XML, slowest first."""

from tools_modules import load_tool, markdown_rows

XML = """<?xml version="1.0"?><testsuites><testsuite name="pytest">
<testcase classname="tests.ops.test_a" name="t1" time="1.5"/>
<testcase classname="tests.ops.test_a.TestX" name="t2" time="2.0"><skipped/></testcase>
<testcase classname="tests.test_b" name="t" time="4.25"><failure/></testcase>
</testsuite></testsuites>"""


def _tool():
    return load_tool("test_times")


def test_files_slowest_first_with_counts(tmp_path, capsys):
    path = tmp_path / "run.xml"
    path.write_text(XML)
    assert _tool().main([str(path)]) == 0
    assert markdown_rows(capsys.readouterr().out) == [
        ["file", "seconds", "tests", "failed", "skipped"],
        ["tests/test_b.py", "4.2", "1", "1", "0"],
        ["tests/ops/test_a.py", "3.5", "2", "0", "1"],
        ["total", "7.8", "3", "", ""]]


def test_before_and_after(tmp_path, capsys):
    before, after = tmp_path / "before.xml", tmp_path / "after.xml"
    before.write_text(XML)
    after.write_text(XML.replace('time="4.25"', 'time="1.25"'))
    _tool().main([str(before), str(after), "--top", "1"])
    row = markdown_rows(capsys.readouterr().out)[1]
    assert row == ["tests/test_b.py", "4.2", "1.2", "-3.0", "1", "1", "0"]
