"""MkDocs hook (mkdocs.yml, `hooks:`): puts benchmarks/README.md and benchmarks/results/
into the site, so that the docs' links to recorded results (`../benchmarks/results/X`,
which also work when the Markdown is read in the repository) resolve and are checked by
`mkdocs build --strict`. They are not in the navigation."""
import os

from mkdocs.structure.files import File, InclusionLevel

_ROOT = os.path.dirname(os.path.abspath(__file__))
_SHARED = ("benchmarks/README.md", "benchmarks/results")


def _sources():
    for entry in _SHARED:
        path = os.path.join(_ROOT, entry)
        if os.path.isfile(path):
            yield entry
            continue
        for folder, _, names in os.walk(path):
            for name in sorted(names):
                yield os.path.relpath(os.path.join(folder, name), _ROOT).replace(os.sep, "/")


def on_files(files, config):
    for relative in _sources():
        # The source path as a docs page would name it ("../benchmarks/..." from docs/),
        # served under benchmarks/ in the site.
        file = File(f"../{relative}", src_dir=config["docs_dir"], dest_dir=config["site_dir"],
                    use_directory_urls=config["use_directory_urls"], inclusion=InclusionLevel.NOT_IN_NAV)
        if relative.endswith(".md"):
            stem = relative[:-len(".md")]
            file.dest_uri = f"{stem}/index.html" if config["use_directory_urls"] else f"{stem}.html"
        else:
            file.dest_uri = relative
        files.append(file)
    return files
