"""The driver package formats: a package's manifest and archive, module signature fields, the user-space
package's manifest. Bytes and files in, facts out; nothing here knows a host."""

# The libraries whose presence makes a driver's user-space usable, both required: a user-space package must
# hold them, and driver/files.py finds a user-space on a host by them. Here, where both can take it cheaply.
KEY_SONAMES = ("libcuda.so.1", "libnvidia-ml.so.1")
# The name of a package's manifest, in the archive and in every tree installed from it.
MANIFEST_NAME = "manifest.json"
