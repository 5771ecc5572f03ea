"""griffe extension for the API reference: this library's docstrings list parameters and fields as
aligned ``name:  text`` lines (readable in ``help()``); in the site they become Markdown lists."""

import re

import griffe

ITEM = re.compile(r"^([a-z_][\w]*):( +)(\S.*)$")


class AlignedLists(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is None:
            return
        out: list[str] = []
        listing = False
        for line in obj.docstring.value.splitlines():
            item = ITEM.match(line)
            if item and len(item[1]) + 1 + len(item[2]) >= 8:  # an aligned column, not prose
                if not listing and out and out[-1].strip():
                    out.append("")
                out.append(f"* **{item[1]}**: {item[3]}")
                listing = True
            elif listing and line.startswith("    ") and line.strip():
                out.append("  " + line.strip())
            else:
                listing = False
                out.append(line)
        obj.docstring.value = "\n".join(out)
