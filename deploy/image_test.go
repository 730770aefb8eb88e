package deploy

import (
	"os/exec"
	"strings"
	"testing"
)

// TestImageStampsVersion: `make image` builds the image's binary with the version and commit
// stamped, as `make build` does. Without it every image says "quotad dev" (quotad version,
// quotad_build_info, the "saved by" line of a snapshot), so during a rolling upgrade in
// containers nothing tells which nodes already run the new image.
func TestImageStampsVersion(t *testing.T) {
	out, err := exec.Command("make", "-C", "..", "-n", "image", "VERSION=v9.8.7-imagetest", "COMMIT=c0ffee").CombinedOutput()
	if err != nil {
		t.Fatalf("make -n image: %v\n%s", err, out)
	}
	var build string
	for _, line := range strings.Split(string(out), "\n") {
		if strings.Contains(line, " build ") && strings.Contains(line, "bin/image/quotad") {
			build = line
		}
	}
	if build == "" {
		t.Fatalf("make -n image runs no go build of bin/image/quotad:\n%s", out)
	}
	for _, want := range []string{"internal/buildinfo.version=v9.8.7-imagetest", "internal/buildinfo.commit=c0ffee", "CGO_ENABLED=0"} {
		if !strings.Contains(build, want) {
			t.Errorf("the image's go build does not set %s:\n%s", want, build)
		}
	}
}
