"""README.md quotes the demo's numbers as docs/demo_results.json holds them (`bash
tools/quickstart.sh --publish` writes that file), so the README cannot drift from what the
current code produces."""
import json
import os

from megatron_lev.demo import readme_figures, unquoted_figures

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_quotes_docs_demo_results():
    with open(os.path.join(REPO, "docs", "demo_results.json"), encoding="utf-8") as f:
        results = json.load(f)
    readme = os.path.join(REPO, "README.md")
    # 4 losses, the ppl change, the speed-up, 2 ppl; over 3 seeds the loss difference and the ppl
    # change (mean ± std) and the t-test's p
    assert len(results["seeds"]["per_seed"]) == 3 and len(readme_figures(results)) == 11
    missing = unquoted_figures(results, readme)
    assert not missing, f"README.md does not quote docs/demo_results.json: {missing}"
    with open(readme, encoding="utf-8") as f:
        assert len(f.read().splitlines()) < 120  # the short README; long sections live in docs/
