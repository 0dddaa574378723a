// SPDX-License-Identifier: GPL-2.0
/* Test stand-in for nvidia-modeset.ko: holds nvidia through its symbol, exports one for nvidia-drm. */
#include <linux/module.h>

extern int nv_standin_api_version(void);
static bool hdmi_deepcolor = 1;
module_param(hdmi_deepcolor, bool, 0444);
MODULE_PARM_DESC(hdmi_deepcolor, "deep colour (bool)");

int nvkms_standin_api_version(void)
{
	return nv_standin_api_version();
}
EXPORT_SYMBOL(nvkms_standin_api_version);

static int __init nvkms_init(void)
{
	pr_info("nvidia-modeset: stand-in %s on nvidia API %d\n", NV_VERSION_STRING, nv_standin_api_version());
	return 0;
}

static void __exit nvkms_exit(void)
{
}

module_init(nvkms_init);
module_exit(nvkms_exit);
MODULE_LICENSE("GPL");
MODULE_VERSION(NV_VERSION_STRING);
MODULE_DESCRIPTION("driverd test stand-in for nvidia-modeset");
