// A stand-in for a GPU device plugin, for the tests on the real node (tests/node): it registers with the
// kubelet through the device-plugin API (k8s.io/kubelet deviceplugin/v1beta1, the contract NVIDIA's
// k8s-device-plugin implements) and advertises -devices devices of -resource, so that the kubelet itself
// publishes the Node's allocatable. With -stale, it behaves like a plugin that kept the old driver's
// handles: once the file -driver-file (the host's /proc/driver/nvidia/version) differs from what it read
// at start, it reports every device Unhealthy, and the kubelet's allocatable drops to 0 until it is
// restarted. Never shipped: test-only, built by tests/node/deviceplugin.py.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"path/filepath"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	devices    int
	stale      bool
	driverFile string
	seen       string
}

func readFile(p string) string {
	b, err := os.ReadFile(p)
	if err != nil {
		return ""
	}
	return string(b)
}

func (p *plugin) list(health string) *pluginapi.ListAndWatchResponse {
	out := &pluginapi.ListAndWatchResponse{}
	for i := 0; i < p.devices; i++ {
		out.Devices = append(out.Devices, &pluginapi.Device{ID: fmt.Sprintf("gpu-%d", i), Health: health})
	}
	return out
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

func (p *plugin) ListAndWatch(_ *pluginapi.Empty, s pluginapi.DevicePlugin_ListAndWatchServer) error {
	health := pluginapi.Healthy
	if err := s.Send(p.list(health)); err != nil {
		return err
	}
	for {
		time.Sleep(500 * time.Millisecond)
		if p.stale && health == pluginapi.Healthy && readFile(p.driverFile) != p.seen {
			health = pluginapi.Unhealthy
			log.Printf("the driver changed under this plugin: its %d devices are unhealthy now", p.devices)
			if err := s.Send(p.list(health)); err != nil {
				return err
			}
		}
	}
}

func (p *plugin) Allocate(_ context.Context, r *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	out := &pluginapi.AllocateResponse{}
	for range r.ContainerRequests {
		out.ContainerResponses = append(out.ContainerResponses, &pluginapi.ContainerAllocateResponse{})
	}
	return out, nil
}

func main() {
	resource := flag.String("resource", "nvidia.com/gpu", "the extended resource advertised")
	devices := flag.Int("devices", 2, "how many devices")
	stale := flag.Bool("stale", false, "report every device unhealthy once -driver-file changes")
	driverFile := flag.String("driver-file", "/host/proc/driver/nvidia/version", "the driver's version file")
	dir := flag.String("dir", pluginapi.DevicePluginPath, "the kubelet's device-plugin directory")
	flag.Parse()
	p := &plugin{devices: *devices, stale: *stale, driverFile: *driverFile, seen: readFile(*driverFile)}
	// A socket of this instance's own: in a pod the plugin is PID 1, so "standin-<pid>" named every
	// instance's socket alike, and the kubelet does not support a new plugin taking over an old one's socket
	// (kubernetes/kubernetes#135437, #139338: the old endpoint's late disconnection can unregister the new
	// one, the node's allocatable dropping to 0 after the new plugin registered). The pod's name is its host name.
	host, _ := os.Hostname()
	endpoint := fmt.Sprintf("standin-%s-%d.sock", host, os.Getpid())
	sock := filepath.Join(*dir, endpoint)
	_ = os.Remove(sock)
	lis, err := net.Listen("unix", sock)
	if err != nil {
		log.Fatalf("listen %s: %v", sock, err)
	}
	srv := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(srv, p)
	go func() { _ = srv.Serve(lis) }()
	conn, err := grpc.NewClient("unix://"+filepath.Join(*dir, "kubelet.sock"),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatalf("kubelet socket: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version: pluginapi.Version, Endpoint: endpoint, ResourceName: *resource})
	if err != nil {
		log.Fatalf("register with the kubelet: %v", err)
	}
	log.Printf("registered %s with %d devices (stale=%v)", *resource, *devices, *stale)
	select {}
}
