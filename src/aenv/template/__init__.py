"""Templates from users' own images: the image side (pull, unpack, base disk layer).

The template builds (``builds``: the E2B template build API and ``aenv template build``) start
a build from ``fromImage``; this package turns that reference into a verified local image and a
qcow2 base layer the build VM boots from::

    store = ImageStore()                                   # <node home>/images
    image = store.pull("docker.io/library/debian:12", Credentials("u", "p"))   # or None
    image = store.import_oci_layout(path) / store.import_docker_archive(path)
    disk = base_layer(image)                               # cached per image
    image.config.env, image.config.user, image.config.working_dir, image.config.command

Everything here is blocking (network, disk, subprocesses): call it from a worker thread in
async code. Errors are ``ImageError`` subclasses whose ``status`` is the HTTP status to answer.
"""

from aenv.template.disk import base_layer
from aenv.template.image import (
    Image,
    ImageConfig,
    ImageError,
    ImageNotFound,
    IntegrityError,
    InvalidReference,
    Layer,
    LayerRefused,
    RegistryAuthError,
    RegistryError,
    UnsupportedImage,
)
from aenv.template.registry import Credentials
from aenv.template.store import ImageStore
from aenv.template.unpack import unpack

__all__ = [
    "Credentials",
    "Image",
    "ImageConfig",
    "ImageError",
    "ImageNotFound",
    "ImageStore",
    "IntegrityError",
    "InvalidReference",
    "Layer",
    "LayerRefused",
    "RegistryAuthError",
    "RegistryError",
    "UnsupportedImage",
    "base_layer",
    "unpack",
]
