// SPDX-License-Identifier: GPL-2.0
/* Test stand-in for nvidia-drm.ko: depends on nvidia-modeset (and through it on nvidia). */
#include <linux/module.h>

extern int nvkms_standin_api_version(void);
static bool modeset;
module_param(modeset, bool, 0444);
MODULE_PARM_DESC(modeset, "kernel modesetting (bool)");

static int __init nvdrm_init(void)
{
	pr_info("nvidia-drm: stand-in %s on nvidia-modeset API %d\n", NV_VERSION_STRING,
		nvkms_standin_api_version());
	return 0;
}

static void __exit nvdrm_exit(void)
{
}

module_init(nvdrm_init);
module_exit(nvdrm_exit);
MODULE_LICENSE("GPL");
MODULE_VERSION(NV_VERSION_STRING);
MODULE_DESCRIPTION("driverd test stand-in for nvidia-drm");
