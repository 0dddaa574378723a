"""The driver package formats: a package's manifest and archive, module signature fields, the user-space
package's manifest. Bytes and files in, facts out; nothing here knows a host."""
