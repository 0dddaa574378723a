"""Where packages come from: a repository's index and its signature, fetching (kernel and user-space
packages), the download cache."""
