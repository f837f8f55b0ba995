/* The arm64 guest's initramfs /init (scripts/arm64_guest.sh builds it with aarch64-linux-gnu-gcc -static).
 *
 * Debian's cloud kernel has ext4 built in but virtio as modules, so the root disk needs an initramfs. This one
 * replaces mkinitramfs's, which took minutes to generate under qemu-user at every build: it loads the modules
 * listed in /modules (one path a line, dependencies first: the build orders them from modules.dep), mounts
 * root= (the kernel command line) and executes init= there, as initramfs-tools' init would.
 *
 * Rules this file keeps:
 * - Any failure exits, and the kernel panics when init exits: with panic=-1 and qemu's -no-reboot the machine
 *   stops at once, so a broken initramfs costs one boot, never the test's whole time limit.
 * - No libc beyond the syscalls' wrappers and stdio: static, so the initramfs holds no shared libraries.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* How long the root disk may take to appear once its driver is loaded: virtio's PCI probe is asynchronous
 * to the module's load, and an emulated machine on a loaded host is slow. */
#define ROOT_WAIT_S 60

static void die(const char *what, const char *arg) {
  fprintf(stderr, "initrd: %s %s: %s\n", what, arg, strerror(errno));
  exit(1);
}

/* The value of `key` (e.g. "root=") on the kernel command line, copied into `out`; `fallback` when absent. */
static void cmdline_value(const char *cmdline, const char *key, char *out, size_t size, const char *fallback) {
  size_t len = strlen(key);
  snprintf(out, size, "%s", fallback);
  for (const char *p = cmdline; *p;) {
    const char *end = p + strcspn(p, " \n");
    if ((size_t)(end - p) > len && strncmp(p, key, len) == 0) {
      snprintf(out, size, "%.*s", (int)(end - p - len), p + len);
    }
    p = *end ? end + 1 : end;
  }
}

static int cmdline_has(const char *cmdline, const char *word) {
  size_t len = strlen(word);
  for (const char *p = cmdline; *p;) {
    size_t n = strcspn(p, " \n");
    if (n == len && strncmp(p, word, len) == 0) return 1;
    p += n + (p[n] != 0);
  }
  return 0;
}

static void load_modules(void) {
  FILE *list = fopen("/modules", "r");
  char path[512];
  if (!list) die("open", "/modules");
  while (fgets(path, sizeof path, list)) {
    path[strcspn(path, "\n")] = 0;
    if (!*path) continue;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) die("open", path);
    /* EEXIST: built in or loaded already, which is what is wanted. */
    if (syscall(SYS_finit_module, fd, "", 0) != 0 && errno != EEXIST) die("finit_module", path);
    close(fd);
  }
  fclose(list);
}

static void wait_for(const char *device) {
  struct stat st;
  struct timespec tick = {0, 20 * 1000 * 1000};
  for (int i = 0; i < ROOT_WAIT_S * 50; i++) {
    if (stat(device, &st) == 0) return;
    nanosleep(&tick, NULL);
  }
  die("no root device after waiting for it:", device);
}

int main(void) {
  char cmdline[4096] = "", root[256], init[256];
  if (mount("devtmpfs", "/dev", "devtmpfs", 0, NULL) != 0) die("mount", "/dev");
  if (mount("proc", "/proc", "proc", 0, NULL) != 0) die("mount", "/proc");
  FILE *f = fopen("/proc/cmdline", "r");
  if (!f) die("open", "/proc/cmdline");
  if (!fgets(cmdline, sizeof cmdline, f)) die("read", "/proc/cmdline");
  fclose(f);
  cmdline_value(cmdline, "root=", root, sizeof root, "/dev/vda");
  cmdline_value(cmdline, "init=", init, sizeof init, "/sbin/init");
  unsigned long flags = cmdline_has(cmdline, "rw") ? 0 : MS_RDONLY;

  load_modules();
  wait_for(root);
  if (mount(root, "/root", "ext4", flags, NULL) != 0) die("mount", root);
  /* The root takes over /dev with devpts on /dev/pts, as initramfs-tools' init handed them over (the guest's
   * init mounts no devpts itself); /proc is the root's init's to mount. */
  if (mkdir("/dev/pts", 0755) != 0 && errno != EEXIST) die("mkdir", "/dev/pts");
  if (mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "gid=5,mode=0620") != 0) die("mount", "/dev/pts");
  if (mount("/dev", "/root/dev", NULL, MS_MOVE, NULL) != 0) die("move /dev to", "/root/dev");
  if (umount("/proc") != 0) die("umount", "/proc");
  if (chdir("/root") != 0) die("chdir", "/root");
  if (mount(".", "/", NULL, MS_MOVE, NULL) != 0) die("move the root to", "/");
  if (chroot(".") != 0 || chdir("/") != 0) die("chroot", root);
  /* The console the kernel opened lies in the initramfs; the root's own is the same device. */
  int console = open("/dev/console", O_RDWR);
  if (console >= 0) {
    dup2(console, 0), dup2(console, 1), dup2(console, 2);
    if (console > 2) close(console);
  }
  char *argv[] = {init, NULL};
  execv(init, argv);
  die("exec", init);
}
