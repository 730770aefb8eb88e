package wal

import (
	"errors"
	"os"

	"golang.org/x/sys/unix"
)

// datasync makes f's written data durable (fdatasync: the data and the metadata needed to read
// it back, such as a grown size; not the modification time).
func datasync(f *os.File) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		for {
			serr = unix.Fdatasync(int(fd))
			if !errors.Is(serr, unix.EINTR) {
				return
			}
		}
	}); err != nil {
		return err
	}
	if serr != nil {
		return &os.PathError{Op: "fdatasync", Path: f.Name(), Err: serr}
	}
	return nil
}

// preallocate reserves size bytes for f (the file's size becomes size; the new part reads as
// zeros). ok is false where the file system cannot (the file then grows with each write).
func preallocate(f *os.File, size int64) (ok bool, err error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return false, err
	}
	var ferr error
	if err := rc.Control(func(fd uintptr) {
		for {
			ferr = unix.Fallocate(int(fd), 0, 0, size)
			if !errors.Is(ferr, unix.EINTR) {
				return
			}
		}
	}); err != nil {
		return false, err
	}
	switch {
	case ferr == nil:
		return true, nil
	case errors.Is(ferr, unix.EOPNOTSUPP), errors.Is(ferr, unix.ENOSYS):
		return false, nil
	}
	return false, &os.PathError{Op: "fallocate", Path: f.Name(), Err: ferr}
}

// lockDir takes an exclusive advisory lock on the open directory d, so that two processes
// never write one log.
func lockDir(d *os.File) error {
	rc, err := d.SyscallConn()
	if err != nil {
		return err
	}
	var lerr error
	if err := rc.Control(func(fd uintptr) { lerr = unix.Flock(int(fd), unix.LOCK_EX|unix.LOCK_NB) }); err != nil {
		return err
	}
	return lerr
}
