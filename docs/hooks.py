"""mkdocs hook: the plots the example scripts write to ``examples/`` are part of the site."""

from pathlib import Path

from mkdocs.structure.files import File


def on_files(files, config):
    root = Path(config["config_file_path"]).parent
    for png in sorted((root / "examples").glob("*.png")):
        files.append(File(f"examples/{png.name}", str(root), config["site_dir"], config["use_directory_urls"]))
    return files
