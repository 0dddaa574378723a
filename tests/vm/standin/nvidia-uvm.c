// SPDX-License-Identifier: GPL-2.0
/* Test stand-in for nvidia-uvm.ko: uses nvidia's exported symbol (the kernel makes it a holder of
 * nvidia) and registers a dynamic character major named nvidia-uvm, as the real one does. */
#include <linux/module.h>
#include <linux/fs.h>

extern int nv_standin_api_version(void);
static unsigned int uvm_perf_prefetch_enable = 1;
module_param(uvm_perf_prefetch_enable, uint, 0444);
MODULE_PARM_DESC(uvm_perf_prefetch_enable, "prefetch (uint)");
static int uvm_major;
static const struct file_operations uvm_fops = { .owner = THIS_MODULE };

static int __init uvm_init(void)
{
	uvm_major = register_chrdev(0, "nvidia-uvm", &uvm_fops);
	if (uvm_major < 0)
		return uvm_major;
	pr_info("nvidia-uvm: stand-in %s on nvidia API %d\n", NV_VERSION_STRING, nv_standin_api_version());
	return 0;
}

static void __exit uvm_exit(void)
{
	unregister_chrdev(uvm_major, "nvidia-uvm");
}

module_init(uvm_init);
module_exit(uvm_exit);
MODULE_LICENSE("GPL");
MODULE_VERSION(NV_VERSION_STRING);
MODULE_DESCRIPTION("driverd test stand-in for nvidia-uvm");
