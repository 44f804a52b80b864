"""Whether a location is a Hugging Face model folder, checked from its files without loading anything.

The one check of a model folder: the driver runs it on every model of a config before Ray starts
(`pipeline.preflight`), and the workers run it again just before loading (`workers.loading`), where an s3:// model
has become a local copy. Locations are plain paths or fsspec URLs; `builtin:` names are resolved before this layer.
Stays free of torch and transformers, so the driver's checks are quick.
"""

from __future__ import annotations

import posixpath

import fsspec


def model_folder_problem(location: str, field: str, shown: str | None = None) -> str | None:
    """Why `location` is not a Hugging Face model folder (it must hold ``config.json``), or None.

    `field` names the config field in the message; `shown` is the location as the user wrote it (e.g. its
    ``builtin:`` name), when it differs from `location`.
    """
    shown = shown or location
    try:
        fs, root = fsspec.core.url_to_fs(location)
        if not fs.exists(root):
            return f"{field}: {shown} does not exist"
        if not fs.isfile(posixpath.join(root.rstrip("/"), "config.json")):
            return f"{field}: {shown} is not a Hugging Face model folder (no config.json in it)"
    except (OSError, ValueError, ImportError) as err:
        return f"{field}: {shown} cannot be read ({err})"
    return None
