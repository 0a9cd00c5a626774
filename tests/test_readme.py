"""README.md quotes the demo's numbers as docs/demo_results.json holds them (the default demo
writes that file), so the README cannot drift from what the current code produces."""
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_quotes_docs_demo_results():
    with open(os.path.join(REPO, "docs", "demo_results.json"), encoding="utf-8") as f:
        results = json.load(f)
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    quoted = [f"{results['valid_loss'][name]['final']:.4f}" for name in ("lev", "tied")]
    quoted += [f"{results['valid_loss'][name]['initial']:.4f}" for name in ("lev", "tied")]
    quoted.append(f"{results['perplexity']['relative_change_pct']['lev']:+.1f}%")
    quoted.append(f"{results['tokens_to_baseline_final']['lev']['speedup']:.2f}x")
    quoted += [f"{results['perplexity']['values'][name]:.1f}" for name in ("lev", "tied")]
    missing = [q for q in quoted if q not in readme]
    assert not missing, f"README.md does not quote docs/demo_results.json: {missing}"
    assert len(readme.splitlines()) < 120  # the short README; long sections live in docs/
