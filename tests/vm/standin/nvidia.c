// SPDX-License-Identifier: GPL-2.0
/*
 * Test stand-in for NVIDIA's nvidia.ko (driverd's VM tests only; never shipped). It does what driverd
 * relies on from the real module without a GPU: typed NVreg_* parameters, /proc/driver/nvidia/version
 * in the real driver's format, one entry under /proc/driver/nvidia/gpus, the character device major
 * 195 (/dev/nvidia0, /dev/nvidiactl) whose open file holds a reference on the module, and an exported
 * symbol the other stand-ins use (so the kernel records them as holders). NVreg_StandinFailInit=1 makes
 * its init fail with -ENODEV after printing NVRM lines, the way the real driver fails without a GPU.
 */
#include <linux/module.h>
#include <linux/fs.h>
#include <linux/proc_fs.h>
#include <linux/seq_file.h>

#define NV_MAJOR 195

static int NVreg_ResmanDebugLevel = -1;
module_param(NVreg_ResmanDebugLevel, int, 0444);
MODULE_PARM_DESC(NVreg_ResmanDebugLevel, "debug level (int)");
static unsigned int NVreg_EnableMSI = 1;
module_param(NVreg_EnableMSI, uint, 0444);
MODULE_PARM_DESC(NVreg_EnableMSI, "use MSI interrupts (uint)");
static ushort NVreg_DeviceFileMode = 0666;
module_param(NVreg_DeviceFileMode, ushort, 0444);
MODULE_PARM_DESC(NVreg_DeviceFileMode, "mode of /dev/nvidia* (ushort)");
static char *NVreg_RegistryDwords;
module_param(NVreg_RegistryDwords, charp, 0444);
MODULE_PARM_DESC(NVreg_RegistryDwords, "registry keys (charp)");
static bool NVreg_StandinFailInit;
module_param(NVreg_StandinFailInit, bool, 0444);
MODULE_PARM_DESC(NVreg_StandinFailInit, "test stand-in: fail the init with ENODEV (bool)");

static struct proc_dir_entry *nv_proc;

int nv_standin_api_version(void)
{
	return 1;
}
EXPORT_SYMBOL(nv_standin_api_version);

static int nv_version_show(struct seq_file *m, void *v)
{
	seq_printf(m, "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  %s  Release Build  "
		   "(driverd-standin)  Thu Jan  1 00:00:00 UTC 2026\nGCC version:  stand-in\n", NV_VERSION_STRING);
	return 0;
}

static int nv_gpu_show(struct seq_file *m, void *v)
{
	seq_puts(m, "Model: \t\t driverd stand-in GPU\nBus Location: \t 0001:00:00.0\nDevice Minor: \t 0\n");
	return 0;
}

static int nv_open(struct inode *inode, struct file *file)
{
	return 0;
}

static const struct file_operations nv_fops = {
	.owner = THIS_MODULE,
	.open = nv_open,
};

static int __init nv_init(void)
{
	struct proc_dir_entry *gpus, *gpu;
	int rc;

	if (NVreg_StandinFailInit) {
		pr_err("NVRM: driverd stand-in %s: init failure requested (NVreg_StandinFailInit=1)\n",
		       NV_VERSION_STRING);
		pr_err("NVRM: None of the NVIDIA devices were initialized.\n");
		return -ENODEV;
	}
	rc = register_chrdev(NV_MAJOR, "nvidia", &nv_fops);
	if (rc < 0)
		return rc;
	nv_proc = proc_mkdir("driver/nvidia", NULL);
	gpus = nv_proc ? proc_mkdir("gpus", nv_proc) : NULL;
	/* the stand-in GPU's PCI address: tests/vm/guest.py adds a PCI function there in the guest's sysfs */
	gpu = gpus ? proc_mkdir("0001:00:00.0", gpus) : NULL;
	if (!gpu || !proc_create_single("version", 0444, nv_proc, nv_version_show) ||
	    !proc_create_single("information", 0444, gpu, nv_gpu_show)) {
		proc_remove(nv_proc);
		unregister_chrdev(NV_MAJOR, "nvidia");
		return -ENOMEM;
	}
	pr_info("NVRM: loading driverd stand-in %s (NVreg_EnableMSI=%u NVreg_ResmanDebugLevel=%d)\n",
		NV_VERSION_STRING, NVreg_EnableMSI, NVreg_ResmanDebugLevel);
	return 0;
}

static void __exit nv_exit(void)
{
	proc_remove(nv_proc);
	unregister_chrdev(NV_MAJOR, "nvidia");
	pr_info("NVRM: driverd stand-in %s unloaded\n", NV_VERSION_STRING);
}

module_init(nv_init);
module_exit(nv_exit);
MODULE_LICENSE("GPL");
MODULE_VERSION(NV_VERSION_STRING);
MODULE_DESCRIPTION("driverd test stand-in for nvidia");
