"""Making packages: the kernel modules from NVIDIA's sources, the user-space from NVIDIA's .run, a
kernel matrix as a Job, the compiler cache, progress, module signing and the signer verdict."""
