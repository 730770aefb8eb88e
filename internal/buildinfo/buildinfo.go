// Package buildinfo says which quotad this is: the version and commit stamped at build time
// (make build: -ldflags "-X .../internal/buildinfo.version=... -X ...commit=..."), else what
// the Go toolchain recorded (the module version of `go install ...@vX`, the VCS revision).
package buildinfo

import (
	"runtime"
	"runtime/debug"
	"sync"
)

// Set by the linker (-X); empty in a plain `go build`.
var (
	version string
	commit  string
)

// Info describes the running binary.
type Info struct {
	Version   string // release version or `git describe`; "dev" when unknown
	Commit    string // VCS revision; "" when unknown
	GoVersion string // toolchain that built it
}

var (
	once sync.Once
	info Info
)

// Get returns the binary's build information.
func Get() Info {
	once.Do(func() { info = read(version, commit) })
	return info
}

func read(version, commit string) Info {
	i := Info{Version: version, Commit: commit, GoVersion: runtime.Version()}
	if bi, ok := debug.ReadBuildInfo(); ok {
		if i.Version == "" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
			i.Version = bi.Main.Version
		}
		modified := false
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				if i.Commit == "" {
					i.Commit = s.Value
				}
			case "vcs.modified":
				modified = s.Value == "true"
			}
		}
		if modified && commit == "" && i.Commit != "" {
			i.Commit += "-dirty"
		}
	}
	if i.Version == "" {
		i.Version = "dev"
	}
	return i
}

// String is the one-line form `quotad version` prints.
func (i Info) String() string { return "quotad " + i.Short() + " " + i.GoVersion }

// Short is the version and commit, as snapshot headers record them: "v1.4.0 (commit 1a2b3c)".
func (i Info) Short() string {
	if i.Commit == "" {
		return i.Version
	}
	return i.Version + " (commit " + i.Commit + ")"
}
